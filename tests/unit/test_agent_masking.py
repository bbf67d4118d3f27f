"""Multi-turn masking on hand-built token sequences: feedback tokens are context, never actions.

The row used throughout (prompt P, model turns a/b, feedback f):

    tokens        P1 P2 | a1 a2 f1 f2 b1 | pad
    action_mask           1  1  0  0  1     0
"""

import pytest
import torch

from orlhf.algo.advantages import actions_first, compute_advantages
from orlhf.algo.losses import policy_loss
from orlhf.algo.registry import ESTIMATORS
from orlhf.algo.rewards import group_baseline, shape_rewards
from orlhf.rollout.executor import episode_to_rollout
from orlhf.trainer.experience import ExperienceConfig, make_experience, rollouts_to_batch
from orlhf.types import Rollout

PAD = 0
MASK = [1, 1, 0, 0, 1]


def multi_turn_rollout() -> Rollout:
    return Rollout(
        prompt_index=0,
        prompt_ids=[11, 12],
        response_ids=[21, 22, 31, 32, 23],
        logprobs=[-0.5, -0.6, 0.0, 0.0, -0.7],
        finished=True,
        action_mask=MASK,
        reward=1.0,
    )


def single_turn_rollout() -> Rollout:
    return Rollout(prompt_index=1, prompt_ids=[13], response_ids=[24, 25], logprobs=[-0.1, -0.2], finished=True)


def test_batch_keeps_feedback_as_context_but_not_as_actions():
    batch, engine_lp = rollouts_to_batch([multi_turn_rollout(), single_turn_rollout()], PAD)
    # P = 2 (longest prompt), A = 5 (longest response)
    assert batch.sequences.tolist() == [[11, 12, 21, 22, 31, 32, 23], [PAD, 13, 24, 25, PAD, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0, 0]]
    assert batch.action_mask.int().tolist() == [MASK, [1, 1, 0, 0, 0]]
    assert torch.allclose(engine_lp[0], torch.tensor([-0.5, -0.6, 0.0, 0.0, -0.7]))  # each generated token's


def test_episode_dict_to_rollout_marks_the_action_ranges():
    # OpenRLHF's execute() result: observation = prompt + turn a + feedback + turn b
    out = {
        "observation_tokens": [11, 12, 21, 22, 31, 32, 23],
        "action_ranges": [(2, 4), (6, 7)],
        "rollout_log_probs": [0, 0, -0.5, -0.6, 0, 0, -0.7],
        "reward": torch.tensor(0.5),
        "scores": 1.0,
        "extra_logs": {"x": torch.tensor(2.0)},
    }
    r = episode_to_rollout(out, prompt_index=3, engine=1)
    assert r.prompt_ids == [11, 12] and r.response_ids == [21, 22, 31, 32, 23]
    assert r.action_mask == MASK and r.logprobs == [-0.5, -0.6, 0, 0, -0.7]
    assert (r.reward, r.score, r.extra_logs) == (0.5, 1.0, {"x": 2.0})


def test_score_lands_on_the_last_model_token_and_kl_skips_feedback():
    mask = torch.tensor([MASK], dtype=torch.bool)
    kl = torch.tensor([[0.1, 0.2, 5.0, 5.0, 0.3]])  # large KL on feedback must not count
    rewards = shape_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.1)
    # -0.1 * kl on model tokens, 0 on feedback, score + (-0.03) on b1 (the last model token)
    assert torch.allclose(rewards, torch.tensor([[-0.01, -0.02, 0.0, 0.0, 1.0 - 0.03]]))


def test_gae_skips_the_feedback_gap():
    """GAE over [a1 a2 (f1 f2) b1] equals GAE over the compacted [a1 a2 b1]; feedback gets 0."""
    mask = torch.tensor([MASK], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 9.0, 9.0, 0.5]])  # feedback values must not be bootstrapped from
    gamma, lambd = 0.9, 0.8
    adv, ret = compute_advantages("gae", rewards, mask, values, gamma, lambd)
    # hand-derived on the compacted row r = [0, 0, 1], V = [0.2, 0.4, 0.5]:
    # delta = [0 + .9*.4 - .2, 0 + .9*.5 - .4, 1 - .5] = [0.16, 0.05, 0.5]
    # A = [0.16 + .72*(0.05 + .72*0.5), 0.05 + .72*0.5, 0.5] = [0.4552, 0.41, 0.5]
    expected_raw = torch.tensor([0.4552, 0.41, 0.5])
    assert torch.allclose(ret[0, [0, 1, 4]], expected_raw + torch.tensor([0.2, 0.4, 0.5]), atol=1e-6)
    assert ret[0, 2] == 0 and ret[0, 3] == 0 and adv[0, 2] == 0 and adv[0, 3] == 0
    whitened = (expected_raw - expected_raw.mean()) / expected_raw.var(unbiased=False).sqrt()
    assert torch.allclose(adv[0, [0, 1, 4]], whitened, atol=1e-5)


def test_discounted_return_counts_model_tokens_only():
    mask = torch.tensor([MASK], dtype=torch.bool)
    _, ret = compute_advantages("reinforce", torch.tensor([[0.0, 0.0, 7.0, 7.0, 1.0]]), mask, gamma=0.5)
    # rewards on feedback are dropped; discounting steps over model tokens: G = [0.25, 0.5, -, -, 1]
    assert ret.tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0]]


def test_right_padded_rows_are_unchanged_by_the_compaction():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.4, 0.5, 0.0, 0.0]])
    a1, r1 = compute_advantages("gae", rewards, mask, values, 0.9, 0.95)
    shuffled = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)  # row 0 gets a gap at column 1
    a2, _ = compute_advantages(
        "gae",
        torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]]),
        shuffled,
        torch.tensor([[0.1, 0.0, 0.2, 0.3], [0.4, 0.5, 0.0, 0.0]]),
        0.9,
        0.95,
    )
    assert torch.allclose(a2[0, [0, 2, 3]], a1[0, :3]) and torch.allclose(a2[1], a1[1])


def test_policy_loss_ignores_feedback_positions():
    mask = torch.tensor([MASK], dtype=torch.bool)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0, 0.0, 0.5]])
    new = torch.tensor([[-0.9, -1.1, -1.0, -1.0, -1.0]])
    loss, _ = policy_loss(new, old, adv, mask, eps_clip=0.2)
    wild = new.clone()
    wild[0, 2:4] = torch.tensor([3.0, -9.0])  # any log-prob on feedback tokens
    loss_wild, _ = policy_loss(wild, old, adv, mask, eps_clip=0.2)
    assert loss == loss_wild


def test_experience_of_a_mixed_batch_masks_feedback_everywhere():
    batch, _ = rollouts_to_batch([multi_turn_rollout(), single_turn_rollout()], PAD)
    old = torch.full((2, 5), -1.0)
    ref = old.clone()
    ref[0, 2:4] = -8.0  # reference disagrees strongly on feedback tokens only
    cfg = ExperienceConfig(advantage_estimator="reinforce")
    exp, info = make_experience(batch, torch.tensor([1.0, 0.0]), old, ref, None, 0.5, cfg)
    assert info["kl"] == 0.0  # the feedback disagreement never reaches the KL
    assert exp.advantages[0, 2:4].tolist() == [0.0, 0.0]
    assert info["response_length"] == (3 + 2) / 2  # model tokens only


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_every_estimator_equals_its_compacted_row(estimator):
    """Two prompts x 2 samples; rows 0 and 3 have feedback gaps. Each row's advantages on its model tokens equal
    those of the same batch with the feedback removed; feedback positions get 0."""
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.2])
    kl = torch.rand(4, 5) * 0.1
    values = torch.rand(4, 5)
    gapped = shape_rewards(group_baseline(scores, 2, estimator), kl, mask, 0.05)
    adv, ret = compute_advantages(estimator, gapped, mask, values, gamma=1.0, lambd=0.9)
    order = actions_first(mask)
    dense_mask = mask.gather(1, order)
    dense = shape_rewards(group_baseline(scores, 2, estimator), kl.gather(1, order), dense_mask, 0.05)
    adv2, ret2 = compute_advantages(estimator, dense, dense_mask, values.gather(1, order), gamma=1.0, lambd=0.9)
    assert torch.allclose(adv.gather(1, order), adv2, atol=1e-6) and torch.allclose(ret.gather(1, order), ret2)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
