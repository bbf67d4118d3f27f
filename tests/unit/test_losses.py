"""PPO math in orlhf/algo: every expectation is derived by hand in the comment next to it."""

import math

import pytest
import torch

from orlhf.algo.kl import approx_kl
from orlhf.algo.losses import (
    IsCorrection,
    LossNorm,
    aggregate,
    entropy_from_logits,
    masked_mean,
    policy_loss,
    policy_loss_terms,
    step_norm,
    value_loss,
)

LN = math.log


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_masked_mean_all_and_per_row():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # all: (1 + 2 + 4) / 3 = 7/3
    assert masked_mean(x, m).item() == pytest.approx(7 / 3)
    # per row: [(1 + 2) / 2, 4 / 1] = [1.5, 4]
    assert masked_mean(x, m, dim=1).tolist() == pytest.approx([1.5, 4.0])
    # empty mask: 0, not NaN
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_policy_loss_clips_both_sides():
    # Four tokens, eps 0.2, old log-prob 0:
    #   ratio 1.5, A=+1 -> min(1.5, 1.2) = 1.2 (clipped)
    #   ratio 0.5, A=+1 -> min(0.5, 0.8) = 0.5 (not clipped)
    #   ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 (clipped)
    #   ratio 1.0, A=+2 -> 2.0; masked out
    # loss = -(1.2 + 0.5 - 0.8) / 3 = -0.3; clip_frac = 2/3
    lp = t([LN(1.5), LN(0.5), LN(0.5), 0.0])
    adv = t([1.0, 1.0, -1.0, 2.0])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, frac = policy_loss(lp, torch.zeros_like(lp), adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(-0.3, abs=1e-6)
    assert frac.item() == pytest.approx(2 / 3)


def test_policy_loss_dual_clip_caps_negative_advantages():
    # ratio 5, A=-1, eps 0.2: PPO objective min(-5, -1.2) = -5; dual clip c=3: max(-5, 3 * -1) = -3 -> loss 3.
    # ratio 5, A=+1: min(5, 1.2) = 1.2, dual clip does not apply to A > 0 -> loss -1.2.
    # mean over the 2 tokens: (3 - 1.2) / 2 = 0.9; both tokens take a clipped branch -> clip_frac 1
    lp = t([LN(5.0), LN(5.0)])
    adv = t([-1.0, 1.0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, frac = policy_loss(lp, torch.zeros_like(lp), adv, mask, eps_clip=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(0.9, abs=1e-6)
    assert frac.item() == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, torch.zeros_like(lp), adv, mask, eps_clip=0.2, dual_clip=0.5)


def test_policy_loss_gradient_is_minus_advantage_at_ratio_one():
    # d/dlp of -(exp(lp - old) * A) at lp = old is -A; token-level mean over 2 tokens divides by 2.
    lp = torch.zeros(1, 2, requires_grad=True)
    adv = t([3.0, -1.0])
    loss, _ = policy_loss(lp, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), eps_clip=0.2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.5, 0.5])


def test_value_loss_clipped_and_plain():
    # old 0, clip 0.5, returns 1:
    #   v = 2.0: clipped v = 0.5 -> max((2-1)^2, (0.5-1)^2) = max(1, 0.25) = 1    (unclipped branch)
    #   v = 0.1: clipped v = 0.1 -> (0.1-1)^2 = 0.81 both                        (no clip)
    #   v = -2 : clipped v = -0.5 -> max(9, 2.25) = 9                            (unclipped branch)
    #   v = 0.8, old = 0, returns -1: clipped 0.5 -> max(3.24, 2.25) = 3.24     (unclipped)
    # so clip never binds here; mean = (1 + 0.81 + 9) / 3 (last masked) = 3.6033..; x 0.5 = 1.80167
    v = t([2.0, 0.1, -2.0, 0.8])
    old = torch.zeros_like(v)
    ret = t([1.0, 1.0, 1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, frac = value_loss(v, old, ret, mask, value_clip=0.5)
    assert loss.item() == pytest.approx(0.5 * (1 + 0.81 + 9) / 3, abs=1e-6)
    assert frac.item() == 0.0
    # Clip binds when v overshoots past the target: v = 2, returns 1.8, old 0, clip 0.5: clipped 0.5 ->
    # max((0.2)^2, (-1.3)^2) = 1.69 -> loss 0.5 * 1.69 = 0.845, clip_frac 1.
    loss, frac = value_loss(t([2.0]), t([0.0]), t([1.8]), torch.ones(1, 1, dtype=torch.bool), value_clip=0.5)
    assert loss.item() == pytest.approx(0.845, abs=1e-6)
    assert frac.item() == 1.0
    # No clip: 0.5 * mean squared error = 0.5 * (1 + 0.81 + 9) / 3, old values not needed.
    loss, frac = value_loss(v, None, ret, mask, value_clip=None)
    assert loss.item() == pytest.approx(0.5 * (1 + 0.81 + 9) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(v, None, ret, mask, value_clip=0.5)


def test_approx_kl_estimators():
    # log r = ln 2: k1 = 0.693147; k2 = 0.693147^2 / 2 = 0.240227; k3 = 1/2 - 1 + 0.693147 = 0.193147
    # log r = 0: all zero.
    lp, ref = t([LN(2.0), 0.0]), t([0.0, 0.0])
    assert approx_kl(lp, ref, "k1")[0].tolist() == pytest.approx([0.693147, 0.0], abs=1e-6)
    assert approx_kl(lp, ref, "k2")[0].tolist() == pytest.approx([0.240227, 0.0], abs=1e-6)
    assert approx_kl(lp, ref, "k3")[0].tolist() == pytest.approx([0.193147, 0.0], abs=1e-6)
    # The estimate is clamped to [-10, 10] (OpenRLHF), not log r: log r = -5 -> k3 = exp(5) - 1 - 5 = 142.41
    # unclamped -> 10; k2 = 25 / 2 = 12.5 -> 10; k1 = -5 stays. log r = -100: exp(100) overflows to inf -> 10.
    assert approx_kl(t([-5.0]), t([0.0]), "k3").item() == 10.0
    assert approx_kl(t([-5.0]), t([0.0]), "k2").item() == 10.0
    assert approx_kl(t([-5.0]), t([0.0]), "k1").item() == -5.0
    assert approx_kl(t([-100.0]), t([0.0]), "k3").item() == 10.0
    assert approx_kl(t([50.0]), t([0.0]), "k1").item() == 10.0
    # Below the bound nothing changes: log r = -2 -> k3 = e^2 - 1 - 2 = 4.389056
    assert approx_kl(t([-2.0]), t([0.0]), "k3").item() == pytest.approx(math.exp(2) - 3, abs=1e-5)
    with pytest.raises(ValueError, match="k4"):
        approx_kl(lp, ref, "k4")


def test_k3_gradient_past_the_cap_is_zero_not_nan():
    # log r = -100: exp(100) overflows float32. k3 reads log r bounded below at -10 (e^10 - 1 - 10 > 10, past the
    # cap already), so the value is 10 and the KL loss's gradient 0, where it was 0 * inf = NaN.
    lp = torch.tensor([[-100.0, LN(2.0)]], requires_grad=True)
    approx_kl(lp, torch.zeros(1, 2), "k3").sum().backward()
    # second token: d/dlp (e^-lr - 1 + lr) = 1 - e^-lr = 1 - 1/2 = 0.5
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.5])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_unbiased_kl_gradient_keeps_the_value_and_weights_the_score(estimator):
    # pi = 1/2, ref = 1/4, pi_old = 1/4: log r = ln 2, w = pi / pi_old = 2.
    # Value: the estimator's, unchanged (k1 ln 2, k2 (ln 2)^2 / 2, k3 1/2 - 1 + ln 2).
    # Gradient: w * log r = 2 ln 2 = 1.386294 for every estimator (plain: k1 1, k2 ln 2, k3 1 - 1/2).
    lp = torch.tensor([[LN(0.5)]], requires_grad=True)
    ref, old = t([LN(0.25)]), t([LN(0.25)])
    kl = approx_kl(lp, ref, estimator, old, unbiased_gradient=True)
    assert kl.item() == pytest.approx(approx_kl(lp, ref, estimator).item(), abs=1e-7)
    kl.sum().backward()
    assert lp.grad.item() == pytest.approx(2 * LN(2.0), abs=1e-6)
    # w is at most 10: pi_old = pi / e^5 (w = 148.4) -> 10 ln 2 = 6.931472; no pi_old: w = 1 -> ln 2.
    lp.grad = None
    approx_kl(lp, ref, estimator, t([LN(0.5) - 5.0]), unbiased_gradient=True).sum().backward()
    assert lp.grad.item() == pytest.approx(10 * LN(2.0), abs=1e-5)
    lp.grad = None
    approx_kl(lp, ref, estimator, None, unbiased_gradient=True).sum().backward()
    assert lp.grad.item() == pytest.approx(LN(2.0), abs=1e-6)


def test_entropy_from_logits():
    # uniform over 4: ln 4 = 1.386294; one-hot-ish (logit 100 vs 0s): ~0
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert ent.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


# ---------------------------------------------------------------- aggregation over an optimizer step


def test_aggregate_token_and_sequence_means():
    # rows: [1, 2, 3] (3 tokens), [10, -, -] (1 token), [-, -, -] (empty)
    x = t([1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [5.0, 5.0, 5.0])
    m = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # token mean: (1 + 2 + 3 + 10) / 4 = 4; sequence mean: (2 + 10) / 2 = 6 (the empty row does not count)
    assert aggregate(x, m, "token_mean").item() == pytest.approx(4.0)
    assert aggregate(x, m, "seq_mean").item() == pytest.approx(6.0)
    # With a step norm of 8 tokens / 5 sequences and scale 4 (2 accumulation steps x 2 ranks):
    # token: 16 / 8 * 4 = 8; seq: (2 + 10) / 5 * 4 = 9.6
    norm = LossNorm(tokens=8.0, seqs=5.0, scale=4.0)
    assert aggregate(x, m, "token_mean", norm).item() == pytest.approx(8.0)
    assert aggregate(x, m, "seq_mean", norm).item() == pytest.approx(9.6)
    # step_norm counts real tokens and non-empty rows over the step's micro-batches: 4 + 2 tokens, 2 + 1 rows
    n = step_norm([m, torch.tensor([[1, 1, 0]], dtype=torch.bool)], scale=2.0)
    assert (n.tokens, n.seqs, n.scale) == (6.0, 3.0, 2.0)
    with pytest.raises(ValueError, match="seq_sum"):
        aggregate(x, m, "seq_sum")


def test_step_aggregation_equals_whole_batch_mean_not_mean_of_micro_means():
    # Micro-batch 1 has 1 token of loss 1, micro-batch 2 has 3 tokens of loss 3 (one optimizer step, gas 2).
    # Whole-batch token mean: (1 + 9) / 4 = 2.5. DeepSpeed sums micro losses / gas: with the step norm
    # (4 tokens, scale 2): (1 / 4 * 2 + 9 / 4 * 2) / 2 = 2.5. Mean of micro means: (1 + 3) / 2 = 2.
    a, ma = t([1.0, 0.0, 0.0]), torch.tensor([[1, 0, 0]], dtype=torch.bool)
    b, mb = t([3.0, 3.0, 3.0]), torch.tensor([[1, 1, 1]], dtype=torch.bool)
    norm = step_norm([ma, mb], scale=2.0)
    step = (aggregate(a, ma, norm=norm) + aggregate(b, mb, norm=norm)) / 2
    assert step.item() == pytest.approx(2.5)
    assert ((masked_mean(a, ma) + masked_mean(b, mb)) / 2).item() == pytest.approx(2.0)


# ---------------------------------------------------------------- policy-loss variants


def test_asymmetric_clip_low_and_high():
    # eps_low 0.2, eps_high 0.28 (DAPO), old log-prob 0:
    #   ratio 1.25, A=+1: min(1.25, clip 1.25) = 1.25, not clipped (it would be at symmetric 0.2: 1.2)
    #   ratio 1.5,  A=+1: min(1.5, 1.28) = 1.28, clipped high
    #   ratio 0.5,  A=-1: min(-0.5, -0.8) = -0.8, clipped low
    # per-token loss = [-1.25, -1.28, 0.8]
    lp = t([LN(1.25), LN(1.5), LN(0.5)])
    adv = t([1.0, 1.0, -1.0])
    mask = torch.ones(1, 3, dtype=torch.bool)
    terms = policy_loss_terms(lp, torch.zeros_like(lp), adv, mask, 0.2, 0.28)
    assert terms.loss[0].tolist() == pytest.approx([-1.25, -1.28, 0.8], abs=1e-6)
    assert terms.clipped_high[0].tolist() == [False, True, False]
    assert terms.clipped_low[0].tolist() == [False, False, True]


def test_policy_log_ratio_clamped_before_exp():
    # log r = 100 would overflow exp in float32 (inf * A = inf); clamped to 20: ratio = e^20 = 4.85e8, A = -1
    # -> surr1 = -4.85e8, surr2 = -0.8; min = -4.85e8 -> loss 4.85e8, finite. Gradient 0 past the clamp.
    lp = torch.tensor([[100.0]], requires_grad=True)
    terms = policy_loss_terms(lp, torch.zeros(1, 1), t([-1.0]), torch.ones(1, 1, dtype=torch.bool), 0.2, 0.2)
    assert terms.loss.item() == pytest.approx(math.exp(20), rel=1e-5)
    terms.loss.sum().backward()
    assert lp.grad.item() == 0.0


def test_gspo_uses_one_geometric_mean_ratio_per_sequence():
    # Row 0: token log-ratios ln 2 and ln 0.5 -> mean 0 -> sequence ratio 1 on both tokens: loss = -A = [-1, -1].
    # Row 1: ln 2 on its one real token (padding ignored) -> ratio 2, A=+1, eps 0.2 -> clipped at 1.2 -> -1.2.
    lp = t([LN(2.0), LN(0.5)], [LN(2.0), 7.0])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.ones(2, 2)
    terms = policy_loss_terms(lp, torch.zeros(2, 2), adv, mask, 0.2, 0.2, loss_type="gspo")
    assert terms.loss[0].tolist() == pytest.approx([-1.0, -1.0], abs=1e-6)
    assert terms.loss[1, 0].item() == pytest.approx(-1.2, abs=1e-6)
    assert terms.clipped_high.tolist() == [[False, False], [True, False]]
    # With IS correction GSPO measures the ratio against the engine's log-probs instead of pi_old:
    # engine log-probs ln 2 on row 1 -> sequence ratio 1 -> loss -1.
    eng = t([0.0, 0.0], [LN(2.0), 0.0])
    terms = policy_loss_terms(
        lp,
        torch.zeros(2, 2),
        adv,
        mask,
        0.2,
        0.2,
        loss_type="gspo",
        rollout_log_probs=eng,
        is_correction=IsCorrection.named("tis"),
    )
    assert terms.loss[1, 0].item() == pytest.approx(-1.0, abs=1e-6)


def _is_case(is_type):
    # ratio 1 everywhere (log pi = log pi_old = 0), A = +1: the uncorrected per-token loss is -1.
    # Engine log-probs: w = exp(log pi_old - log pi_engine) = [0.25, 1, 8] on row 0, [2, 2, -] on row 1.
    eng = t([LN(4.0), 0.0, -LN(8.0)], [-LN(2.0), -LN(2.0), 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return policy_loss_terms(
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.ones(2, 3),
        mask,
        0.2,
        0.2,
        rollout_log_probs=eng,
        is_correction=IsCorrection.named(is_type, (0.5, 5.0)),
    )


def test_vllm_is_correction_tis_icepop_seq_mask():
    # tis: weights clamped to [0.5, 5]: [0.5, 1, 5], [2, 2] -> loss = -w; cut where clamped: [T, F, T], [F, F]
    tis = _is_case("tis")
    assert tis.loss[0].tolist() == pytest.approx([-0.5, -1.0, -5.0], abs=1e-6)
    assert tis.loss[1, :2].tolist() == pytest.approx([-2.0, -2.0], abs=1e-6)
    assert tis.is_cut.tolist() == [[True, False, True], [False, False, False]]
    # icepop: tokens outside [0.5, 5] dropped: [0, 1, 0] * -w -> [0, -1, 0]; row 1 -> [-2, -2]
    ice = _is_case("icepop")
    assert ice.loss[0].tolist() == pytest.approx([0.0, -1.0, 0.0], abs=1e-6)
    assert ice.loss[1, :2].tolist() == pytest.approx([-2.0, -2.0], abs=1e-6)
    # seq-mask-tis: row 0 geometric mean = exp((ln .25 + 0 + ln 8) / 3) = 2^(1/3) = 1.26, inside -> kept with
    # unclamped token weights [-0.25, -1, -8]; row 1: 2, inside -> [-2, -2]. Nothing cut.
    seq = _is_case("seq-mask-tis")
    assert seq.loss[0].tolist() == pytest.approx([-0.25, -1.0, -8.0], abs=1e-5)
    assert not seq.is_cut.any()
    # With thresholds (0.5, 1.5) row 1's geometric mean 2 is outside: the whole row is masked (and counted cut).
    eng = t([LN(4.0), 0.0, -LN(8.0)], [-LN(2.0), -LN(2.0), 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    narrow = policy_loss_terms(
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.ones(2, 3),
        mask,
        0.2,
        0.2,
        rollout_log_probs=eng,
        is_correction=IsCorrection.named("seq-mask-tis", (0.5, 1.5)),
    )
    assert narrow.loss[1].tolist() == [0.0, 0.0, 0.0] and narrow.is_cut.tolist() == [[False] * 3, [True, True, False]]
    with pytest.raises(ValueError, match="engine"):
        policy_loss_terms(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1, dtype=torch.bool),
            0.2,
            0.2,
            is_correction=IsCorrection.named("tis"),
        )


def test_is_correction_gated_by_a_divergence():
    # ratio 1 (log pi = log pi_old), A = +1: uncorrected per-token loss -1. Trainer / engine probabilities of the
    # sampled tokens: (0.5, 0.4), (0.2, 0.5), (0.9, 0.9); w = trainer / engine = 1.25, 0.4, 1.
    #   tv = |engine - trainer| = 0.1, 0.3, 0; with HIGH 0.2 the second token is masked, the others keep w:
    #   loss = [-1.25, 0, -1]
    #   binary_kl(engine || trainer) = 0.4 ln(0.4/0.5) + 0.6 ln(0.6/0.5) = 0.020136, 0.5 ln(2.5) + 0.5 ln(0.625) =
    #   0.223144, 0; with HIGH 0.1: the same cut.
    #   seq level, tv: the row's mean tv 0.4 / 3 = 0.1333 <= 0.2: nothing masked, loss = -w = [-1.25, -0.4, -1].
    train, engine = t([LN(0.5), LN(0.2), LN(0.9)]), t([LN(0.4), LN(0.5), LN(0.9)])
    mask = torch.ones(1, 3, dtype=torch.bool)

    def loss(level, gating, high):
        spec = IsCorrection(level, "mask", gating, (0.0, high))
        terms = policy_loss_terms(train, train, torch.ones(1, 3), mask, 0.2, 0.2, None, "ppo", engine, spec)
        return terms.loss[0].tolist(), terms.is_cut[0].tolist()

    assert loss("token", "tv", 0.2) == (pytest.approx([-1.25, 0.0, -1.0]), [False, True, False])
    assert loss("token", "binary_kl", 0.1) == (pytest.approx([-1.25, 0.0, -1.0]), [False, True, False])
    assert loss("seq", "tv", 0.2) == (pytest.approx([-1.25, -0.4, -1.0]), [False] * 3)
    # 0.11.2's refusals, also on a spec built in code: clip clamps a token ratio only; a divergence has no LOW.
    with pytest.raises(ValueError, match="clip"):
        IsCorrection("seq", "clip")
    with pytest.raises(ValueError, match="upper bound"):
        IsCorrection("token", "mask", "tv", (0.5, 5.0))
