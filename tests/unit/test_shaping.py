"""Reward shaping by length, dynamic filtering, advantage normalization and LR schedules: hand-derived numbers."""

import pytest
import torch

from orlhf.algo.advantages import compute_advantages, whiten
from orlhf.algo.rewards import keep_groups, overlong_penalty, stop_properly_penalty
from orlhf.inputs.rewards import RewardResult
from orlhf.trainer.dynamic_filtering import DynamicFilter
from orlhf.types import Rollout
from orlhf.workers.deepspeed_setup import lr_factor


def test_overlong_penalty_is_linear_in_the_buffer():
    # max 24 tokens, buffer 8: expected = 16. length 10 -> 0; 16 -> 0; 20 -> -(4 / 8) * 1 = -0.5; 24 -> -1;
    # factor 0.5 halves it: length 20 -> -0.25
    lengths = torch.tensor([10, 16, 20, 24])
    assert overlong_penalty(lengths, 24, 8, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_penalty(lengths, 24, 8, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 24, 30, 1.0)


def test_stop_properly_penalty_scales_or_sets():
    scores, cut = torch.tensor([0.8, 0.8, -0.2]), torch.tensor([True, False, True])
    # coef 0.5 scales the cut ones: [0.4, 0.8, -0.1]; coef -0.5 sets them: [-0.5, 0.8, -0.5]
    assert stop_properly_penalty(scores, cut, 0.5).tolist() == pytest.approx([0.4, 0.8, -0.1])
    assert stop_properly_penalty(scores, cut, -0.5).tolist() == pytest.approx([-0.5, 0.8, -0.5])
    with pytest.raises(ValueError):
        stop_properly_penalty(scores, cut, 1.5)


def test_keep_groups_open_range_on_the_group_mean():
    # n = 2: group means 0 (all wrong), 1 (all right), 0.5, 0.25 -> kept iff 0 < mean < 1: F, F, T, T
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.0])
    assert keep_groups(scores, 2, 0.0, 1.0).tolist() == [False, False, True, True]
    # range (0.3, 1): 0.25 now fails
    assert keep_groups(scores, 2, 0.3, 1.0).tolist() == [False, False, True, False]


def test_no_advantage_std_norm_only_centres():
    # x = [1, 3] (third masked): mean 2, var 1 -> whitened [-1, 1]; without the std: [-1, 1] too, so scale x by 4:
    # x = [4, 12]: mean 8, std 4 -> whitened [-1, 1]; centred only: [-4, 4]
    x, m = torch.tensor([[4.0, 12.0, 99.0]]), torch.tensor([[1, 1, 0]], dtype=torch.bool)
    assert whiten(x, m).tolist() == [pytest.approx([-1.0, 1.0, 0.0])]
    assert whiten(x, m, divide_std=False).tolist() == [pytest.approx([-4.0, 4.0, 0.0])]
    # reinforce: returns = rewards on one token each = [4, 12] -> advantages [-4, 4] with std_norm=False
    rewards = torch.tensor([[4.0], [12.0]])
    adv, _ = compute_advantages("reinforce", rewards, torch.ones(2, 1, dtype=torch.bool), std_norm=False)
    assert adv.flatten().tolist() == pytest.approx([-4.0, 4.0])


def test_lr_schedulers():
    # warm-up 2 of 10 steps, then 8 decay steps. Step 6 is halfway (progress 4/8 = 0.5):
    #   cosine_with_min_lr: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55;  cosine: 0.5;  linear: 1 - 0.5 = 0.5
    #   constant_with_warmup: 1 after warm-up (0.5 at step 0); constant: 1 from step 0
    assert lr_factor(6, 2, 10, kind="cosine_with_min_lr") == pytest.approx(0.55)
    assert lr_factor(6, 2, 10, kind="cosine") == pytest.approx(0.5)
    assert lr_factor(6, 2, 10, kind="linear") == pytest.approx(0.5)
    assert lr_factor(10, 2, 10, kind="linear") == 0.0 and lr_factor(10, 2, 10, kind="cosine") == pytest.approx(0.0)
    assert [lr_factor(s, 2, 10, kind="constant_with_warmup") for s in (0, 1, 5)] == [0.5, 1.0, 1.0]
    assert lr_factor(0, 0, 10, kind="constant") == 1.0
    with pytest.raises(ValueError):
        lr_factor(5, 0, 10, kind="exp")


# ---------------------------------------------------------------- the dynamic-filtering loop, on fake engines


def _fake_engine(score_of: dict):
    """generate: n=2 rollouts per prompt; score: the table's score per prompt for both samples (mocks: pure logic)."""
    calls = []

    def generate(prompts, seed_index):
        calls.append((list(prompts), seed_index))
        return [Rollout(i, [p], [1], [0.0], True) for i, p in enumerate(prompts) for _ in range(2)]

    def score(rollouts, prompts):  # rewards differ from scores: the filter must compare scores
        s = torch.tensor([score_of[prompts[r.prompt_index]] for r in rollouts])
        return RewardResult(rewards=s - 5.0, scores=s, extra_logs={"len": torch.arange(len(s), dtype=torch.float)})

    return generate, score, calls


def test_dynamic_filter_refills_until_full_and_keeps_spares():
    # The loader yields batches [10, 11], [12, 13], [14, 15]; the filter reads one only when it runs short.
    # Batch of 2 prompts. Prompts 10, 11 score 0 (all wrong: dropped), 12 scores 1 (all right: dropped);
    # 13 and 14 score 0.5 (kept). Round 0 generates [10, 11] (both dropped), round 1 needs 2: [12, 13] (13 kept),
    # round 2 needs 1: [14] (kept). 5 prompts generated for 2 kept: pass rate 40%, 2.5 generated per kept.
    score_of = {10: 0.0, 11: 0.0, 12: 1.0, 13: 0.5, 14: 0.5, 15: 0.5}
    generate, score, calls = _fake_engine(score_of)
    f = DynamicFilter(2, 2, (0.0, 1.0), generate, score)
    more = iter([[10, 11], [12, 13], [14, 15]])
    out = f.fill(more, step_index=3)
    assert out.prompts == [13, 14] and [r.prompt_index for r in out.rollouts] == [0, 0, 1, 1]
    assert out.reward.scores.tolist() == [0.5] * 4 and out.reward.rewards.tolist() == [-4.5] * 4
    assert out.reward.extra_logs["len"].tolist() == [2.0, 3.0, 0.0, 1.0]  # rows of the kept groups, in order
    assert out.info["dynamic_filtering_pass_rate"] == pytest.approx(40.0)
    assert out.info["dynamic_filtering_generated_per_kept"] == pytest.approx(2.5)
    # every generated sample: (0 + 0 + 1 + .5 + .5) * 2 / 10 = 0.4
    assert out.info["reward_generated_mean"] == pytest.approx(0.4)
    assert [c[0] for c in calls] == [[10, 11], [12, 13], [14]] and len({c[1] for c in calls}) == 3
    assert f.spare == [15]  # drawn from the loader, not yet used: the next step starts with it
    assert f.fill(more, step_index=4) is None  # 15 alone cannot fill a batch of 2: data ran out


def test_dynamic_filter_gives_up_with_a_clear_error():
    generate, score, _ = _fake_engine({i: 0.0 for i in range(100)})
    f = DynamicFilter(1, 2, (0.0, 1.0), generate, score, max_rounds=3)
    with pytest.raises(RuntimeError, match="dynamic_filtering_reward_range"):
        f.fill(iter([[0], [1], [2], [3], [4]]), step_index=0)


def test_dynamic_filter_batch_filled_on_the_last_round_is_kept():
    # max_rounds 2: round 0 generates prompt 0 (scores 0: dropped), round 1, the last allowed, prompt 1 (0.5: kept).
    # The batch is full after that round: a batch, not "kept 1 of 1 prompts after 2 rounds".
    generate, score, calls = _fake_engine({0: 0.0, 1: 0.5})
    f = DynamicFilter(1, 2, (0.0, 1.0), generate, score, max_rounds=2)
    out = f.fill(iter([[0], [1]]), step_index=0)
    assert out.prompts == [1] and [c[0] for c in calls] == [[0], [1]]
    assert out.info["dynamic_filtering_pass_rate"] == pytest.approx(50.0)
    # filled in round 0 with max_rounds 1 (the same edge, one round)
    f = DynamicFilter(1, 2, (0.0, 1.0), *_fake_engine({7: 0.5})[:2], max_rounds=1)
    assert f.fill(iter([[7]]), step_index=0).prompts == [7]


def test_no_advantage_std_norm_holds_for_multi_turn_rows():
    # Row 0: model token, feedback token (mask 0), model token; row 1: one model token. reinforce, gamma 1:
    # returns over the model tokens only: row 0 rewards [0, _, 4] -> G = [4, 4]; row 1 reward [12] -> G = [12].
    # Real tokens [4, 4, 12]: mean 20/3; centred only: [-8/3, -8/3, 16/3]; whitened (std 8*sqrt(2)/3) differs.
    rewards = torch.tensor([[0.0, 0.0, 4.0], [12.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    adv, _ = compute_advantages("reinforce", rewards, mask, std_norm=False)
    assert adv.tolist() == [pytest.approx([-8 / 3, 0.0, -8 / 3]), pytest.approx([16 / 3, 0.0, 0.0])]
    whitened, _ = compute_advantages("reinforce", rewards, mask)
    assert whitened[1, 0].item() == pytest.approx(2**0.5)  # (16/3) / (8 * sqrt(2) / 3)
