"""Experience making when a forward is skipped: no reference model (KL 0) and no old-log-prob forward (single
pass). Each must leave the Experience the actor trains on as it was with the forward run."""

import pytest
import torch

from orlhf.trainer.experience import ExperienceConfig, make_experience
from orlhf.trainer.step_stats import engine_gap, mean_stats
from orlhf.types import Experience, SequenceBatch, TrainStats

B, P, A = 4, 3, 5


def _batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 50, (B, P + A), generator=g)
    action_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), action_mask.long()], 1)
    return SequenceBatch(seq, attn, action_mask)


def _lp(seed: int) -> torch.Tensor:
    return -torch.rand(B, A, generator=torch.Generator().manual_seed(seed))


SCORES = torch.tensor([1.0, 0.0, 0.5, 2.0])


@pytest.mark.parametrize("estimator", ["gae", "group_norm", "reinforce"])
def test_no_reference_gives_the_experience_of_a_zero_kl_coefficient(estimator):
    cfg = ExperienceConfig(advantage_estimator=estimator, n_samples_per_prompt=2 if estimator == "group_norm" else 1)
    values = _lp(3) if estimator == "gae" else None
    with_ref, _ = make_experience(_batch(), SCORES, _lp(1), _lp(2), values, 0.0, cfg)
    without, info = make_experience(_batch(), SCORES, _lp(1), None, values, 0.0, cfg)
    assert torch.equal(with_ref.advantages, without.advantages) and torch.equal(with_ref.action_log_probs, _lp(1))
    assert info["kl"] == 0.0 and without.base_action_log_probs is None
    if values is not None:
        assert torch.equal(with_ref.returns, without.returns)


def test_single_pass_sends_the_engine_log_probs_instead_of_old_ones():
    cfg = ExperienceConfig(advantage_estimator="group_norm", n_samples_per_prompt=2, use_kl_loss=True)
    full, full_info = make_experience(_batch(), SCORES, _lp(1), _lp(2), None, 0.01, cfg)
    single, info = make_experience(_batch(), SCORES, None, _lp(2), None, 0.01, cfg, rollout_log_probs=_lp(4))
    assert torch.equal(full.advantages, single.advantages)  # KL in the loss: the rewards do not read pi_old
    assert single.action_log_probs is None and torch.equal(single.rollout_log_probs, _lp(4))
    assert torch.equal(single.base_action_log_probs, _lp(2)) and full.rollout_log_probs is None
    # the KL figure is then engine log-probs vs ref: k1 = mean over each row's tokens of (engine - ref)
    mask = _batch().action_mask
    k1 = (((_lp(4) - _lp(2)) * mask).sum(-1) / mask.sum(-1)).mean().item()
    assert info["kl"] == pytest.approx(k1, abs=1e-6) and full_info["kl"] != pytest.approx(k1)


def test_a_kl_shaped_reward_cannot_skip_the_old_log_probs():
    with pytest.raises(ValueError, match="old log-probs"):
        make_experience(
            _batch(),
            SCORES,
            None,
            _lp(2),
            None,
            0.01,
            ExperienceConfig(advantage_estimator="reinforce"),
            rollout_log_probs=_lp(4),
        )


def test_engine_gap_from_the_actor_sums_is_the_token_mean():
    mask = _batch().action_mask
    engine, old = _lp(1), _lp(2)
    direct = engine_gap(engine, old, mask, {})
    assert direct == pytest.approx(((engine - old).abs() * mask).sum().item() / mask.sum().item())
    # two ranks x two micro-batches each report (sum, tokens); averaging both alike keeps the ratio exact
    parts = [((engine - old).abs() * mask)[i].sum().item() for i in range(B)]
    stats = [
        TrainStats(
            loss=0.0,
            lr=0.0,
            extra={
                "engine_gap_sum": (parts[2 * r] + parts[2 * r + 1]) / 2,
                "engine_gap_tokens": mask[2 * r : 2 * r + 2].sum().item() / 2,
            },
        )
        for r in range(2)
    ]
    assert engine_gap(engine, None, mask, mean_stats(stats)) == pytest.approx(direct)


def test_split_index_cat_move_tensor_rows_and_carry_none_and_plain_fields():
    batch = _batch()
    exp = Experience(
        batch.sequences, batch.attention_mask, batch.action_mask, None, _lp(1), returns=_lp(2), weight_version=3
    )
    parts = exp.split([1, 3])
    assert [len(p) for p in parts] == [1, 3] and parts[1].num_actions == A
    assert all(p.action_log_probs is None and p.values is None and p.weight_version == 3 for p in parts)
    assert torch.equal(parts[1].returns, exp.returns[1:])
    back = Experience.cat(parts)
    for name in ("sequences", "attention_mask", "action_mask", "advantages", "returns"):
        assert torch.equal(getattr(back, name), getattr(exp, name))
    assert back.action_log_probs is None and back.weight_version == 3
    picked = exp.index(torch.tensor([3, 0]))
    assert torch.equal(picked.advantages, exp.advantages[[3, 0]]) and picked.values is None
    assert torch.equal(SequenceBatch.cat(batch.split([2, 2])).sequences, batch.sequences)
