"""PPO math in orlhf/algo: every expectation is derived by hand in the comment next to it."""

import math

import pytest
import torch

from orlhf.algo.kl import approx_kl
from orlhf.algo.losses import entropy_from_logits, masked_mean, policy_loss, value_loss

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
    # Clamp before the estimator: log r = -50 -> -10; k3 = exp(10) - 1 - 10 = 22015.4658, finite.
    far = approx_kl(t([-50.0]), t([0.0]), "k3")
    assert far.item() == pytest.approx(math.exp(10) - 11, rel=1e-6)
    assert approx_kl(t([50.0]), t([0.0]), "k1").item() == 10.0
    with pytest.raises(ValueError, match="k4"):
        approx_kl(lp, ref, "k4")


def test_entropy_from_logits():
    # uniform over 4: ln 4 = 1.386294; one-hot-ish (logit 100 vs 0s): ~0
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert ent.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)
