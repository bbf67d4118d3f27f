"""Advantages, reward shaping, group baselines, KL controllers: every expectation derived by hand in a comment."""

import math

import pytest
import torch

from orlhf.algo.advantages import compute_advantages, discounted_returns, gae, whiten
from orlhf.algo.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from orlhf.algo.registry import ESTIMATORS
from orlhf.algo.rewards import RunningMoments, group_baseline, shape_rewards


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def mask(*rows):
    return torch.tensor(rows, dtype=torch.bool)


def close(x, expected):
    assert x.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


# --- GAE and discounted returns ----------------------------------------------------------------------------------

# Three rows, A = 3; the middle row is a short response (2 tokens), the last a 1-token one. Padding holds junk
# (9, 7, 5, 4) that must not leak into anything.
REWARDS = t([1.0, 0.0, 2.0], [0.0, 1.0, 9.0], [3.0, 5.0, 5.0])
VALUES = t([0.5, 1.0, 1.0], [2.0, 1.0, 7.0], [1.0, 4.0, 4.0])
MASK = mask([1, 1, 1], [1, 1, 0], [1, 0, 0])


def test_gae_with_discount_and_padding():
    # gamma = 0.5, lambd = 0.5 -> gamma * lambd = 0.25; V after the last real token is 0.
    # row 0: t=2 delta = 2 + 0.5*0 - 1 = 1                 A_2 = 1
    #        t=1 delta = 0 + 0.5*1 - 1 = -0.5              A_1 = -0.5 + 0.25*1 = -0.25
    #        t=0 delta = 1 + 0.5*1 - 0.5 = 1               A_0 = 1 + 0.25*(-0.25) = 0.9375
    #        returns = A + V = [1.4375, 0.75, 2]
    # row 1: t=1 delta = 1 + 0.5*0 - 1 = 0 (padding V 7 masked to 0; unmasked it would be 1 + 3.5 - 1 = 3.5)
    #        t=0 delta = 0 + 0.5*1 - 2 = -1.5              A_0 = -1.5 + 0.25*0 = -1.5
    #        returns = [-1.5 + 2, 0 + 1, 0] = [0.5, 1, 0]
    # row 2: A_0 = 3 - 1 = 2, returns [3, 0, 0]
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=0.5, lambd=0.5)
    close(adv, [[0.9375, -0.25, 1.0], [-1.5, 0.0, 0.0], [2.0, 0.0, 0.0]])
    close(ret, [[1.4375, 0.75, 2.0], [0.5, 1.0, 0.0], [3.0, 0.0, 0.0]])


def test_gae_gamma_one_lambda_one_is_return_minus_value():
    # gamma = 1, lambd = 1: A_t = r_t + r_{t+1} + ... - V_t, returns = sum of rewards from t on.
    # row 0: A_0 = 1 + 0 + 2 - 0.5 = 2.5, A_1 = 0 + 2 - 1 = 1, A_2 = 2 - 1 = 1; returns [3, 2, 2]
    # row 1: A_0 = 0 + 1 - 2 = -1, A_1 = 1 - 1 = 0;                             returns [1, 1, 0]
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lambd=1.0)
    close(adv[:2], [[2.5, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    close(ret[:2], [[3.0, 2.0, 2.0], [1.0, 1.0, 0.0]])


def test_gae_lambda_zero_is_one_step_td():
    # lambd = 0: A_t = delta_t = r_t + gamma V_{t+1} - V_t. row 0, gamma 1: [1 + 1 - 0.5, 0 + 1 - 1, 2 - 1]
    adv, _ = gae(REWARDS, VALUES, MASK, gamma=1.0, lambd=0.0)
    close(adv[0], [1.5, 0.0, 1.0])


def test_discounted_returns_with_padding():
    # gamma = 0.5: G_t = r_t + 0.5 G_{t+1}
    # row 0: G_2 = 2, G_1 = 0 + 1 = 1, G_0 = 1 + 0.5 = 1.5
    # row 1: G_1 = 1, G_0 = 0 + 0.5 = 0.5, padding 0 (its reward 9 is ignored)
    # row 2: G_0 = 3
    close(discounted_returns(REWARDS, MASK, gamma=0.5), [[1.5, 1.0, 2.0], [0.5, 1.0, 0.0], [3.0, 0.0, 0.0]])


# --- whitening -----------------------------------------------------------------------------------------------------


def test_whiten_ignores_padding():
    # real entries 1, 3, 5 (the 100s are padding): mean 3, biased var (4 + 0 + 4) / 3 = 8/3, std = 1.63299
    # -> [-2/1.63299, 0, 2/1.63299] = [-1.224745, 0, 1.224745]; padding stays 0
    x = t([1.0, 3.0, 100.0], [5.0, 100.0, 100.0])
    m = mask([1, 1, 0], [1, 0, 0])
    s = math.sqrt(8 / 3)
    close(whiten(x, m), [[-2 / s, 0.0, 0.0], [2 / s, 0.0, 0.0]])
    # shift_mean=False keeps the mean: + 3 on real entries
    close(whiten(x, m, shift_mean=False), [[-2 / s + 3, 3.0, 0.0], [2 / s + 3, 0.0, 0.0]])


def test_whiten_constant_and_empty():
    # constant real entries: var 0 -> clamped to 1e-8, (x - mean) = 0 -> all 0, no NaN; empty mask -> zeros
    assert whiten(t([2.0, 2.0]), mask([1, 1])).tolist() == [[0.0, 0.0]]
    assert whiten(t([2.0, float("inf")]), mask([0, 0])).tolist() == [[0.0, 0.0]]


# --- reward shaping ------------------------------------------------------------------------------------------------


def test_shape_rewards_kl_penalty_and_clipped_score_on_last_token():
    # kl_coef 0.5, clip [-10, 10], scores [5, -20] -> clipped [5, -10]
    # row 0 (3 tokens): -0.5 * [0.1, 0.2, 0.3] = [-0.05, -0.1, -0.15], + 5 on t=2 -> [-0.05, -0.1, 4.85]
    # row 1 (2 tokens): -0.5 * [0.4, 0.5] = [-0.2, -0.25], -10 on t=1 -> [-0.2, -10.25], padding 0 (kl 9 ignored)
    kl = t([0.1, 0.2, 0.3], [0.4, 0.5, 9.0])
    m = mask([1, 1, 1], [1, 1, 0])
    scores = torch.tensor([5.0, -20.0])
    close(shape_rewards(scores, kl, m, 0.5, (-10.0, 10.0)), [[-0.05, -0.1, 4.85], [-0.2, -10.25, 0.0]])
    # kl_coef 0 (--use_kl_loss) or kl None: only the clipped score
    close(shape_rewards(scores, kl, m, 0.0, (-10.0, 10.0)), [[0.0, 0.0, 5.0], [0.0, -10.0, 0.0]])
    close(shape_rewards(scores, None, m, 0.5), [[0.0, 0.0, 5.0], [0.0, -20.0, 0.0]])


def test_shape_rewards_empty_row_and_negative_coef():
    # a row with no real token gets nothing (the score has no token to sit on)
    out = shape_rewards(torch.tensor([1.0, 2.0]), None, mask([1, 0], [0, 0]), 0.0)
    close(out, [[1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="kl_coef"):
        shape_rewards(torch.tensor([1.0]), None, mask([1]), -0.1)


# --- group baselines: 2 prompts x 3 samples, rows prompt-major -----------------------------------------------------

SCORES = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])  # prompt 0: [1, 2, 6] (mean 3), prompt 1: [0, 0, 3] (mean 1)


def test_group_baseline_rloo():
    # r_i - (group sum - r_i) / 2: prompt 0 sum 9: [1 - 4, 2 - 3.5, 6 - 1.5]; prompt 1 sum 3: [0 - 1.5, 0 - 1.5, 3 - 0]
    assert group_baseline(SCORES, 3, "rloo").tolist() == pytest.approx([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0])


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "dr_grpo"])
def test_group_baseline_mean(estimator):
    # r_i - group mean: [1-3, 2-3, 6-3, 0-1, 0-1, 3-1]
    assert group_baseline(SCORES, 3, estimator).tolist() == pytest.approx([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0])


def test_group_baseline_group_norm_uses_unbiased_std():
    # prompt 0: deviations [-2, -1, 3], unbiased var (4 + 1 + 9) / 2 = 7 -> std sqrt(7)
    # prompt 1: deviations [-1, -1, 2], unbiased var (1 + 1 + 4) / 2 = 3 -> std sqrt(3)
    s7, s3 = math.sqrt(7), math.sqrt(3)
    expected = [-2 / s7, -1 / s7, 3 / s7, -1 / s3, -1 / s3, 2 / s3]
    assert group_baseline(SCORES, 3, "group_norm").tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("estimator", ["gae", "reinforce"])
def test_group_baseline_identity(estimator):
    assert group_baseline(SCORES, 3, estimator).tolist() == SCORES.tolist()


def test_group_baseline_errors():
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=4"):
        group_baseline(SCORES, 4, "rloo")
    with pytest.raises(ValueError, match=">= 2"):
        group_baseline(SCORES, 1, "group_norm")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_baseline(SCORES, 3, "grpo")


# --- compute_advantages --------------------------------------------------------------------------------------------


def test_pipeline_rloo_scores_baseline_shape_advantages():
    # 2 prompts x 2 samples, scores [1, 0, 3, 1]; rloo with n = 2: r_i - other = [1, -1, 2, -2]
    # kl = 1 everywhere, kl_coef 0.1 -> -0.1 per real token; row 1 is a 1-token response
    # rewards: [-0.1, -0.1 + 1], [-0.1 - 1, 0], [-0.1, -0.1 + 2], [-0.1, -0.1 - 2]
    # gamma 1 returns (sum from t on): [0.8, 0.9], [-1.1, 0], [1.8, 1.9], [-2.2, -2.1]; rloo: advantages = returns
    m = mask([1, 1], [1, 0], [1, 1], [1, 1])
    scores = group_baseline(torch.tensor([1.0, 0.0, 3.0, 1.0]), 2, "rloo")
    rewards = shape_rewards(scores, torch.ones(4, 2), m, 0.1)
    adv, ret = compute_advantages("rloo", rewards, m)
    expected = [[0.8, 0.9], [-1.1, 0.0], [1.8, 1.9], [-2.2, -2.1]]
    close(ret, expected)
    close(adv, expected)


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline"])
def test_whitened_critic_free_estimators(estimator):
    # returns gamma 0.5 from the padding example (above): [[1.5, 1, 2], [0.5, 1, 0], [3, 0, 0]]
    # advantages = whiten(returns) over the 6 real tokens; returns stay raw
    gamma = 0.5 if estimator == "reinforce" else 1.0
    adv, ret = compute_advantages(estimator, REWARDS, MASK, gamma=gamma)
    raw = discounted_returns(REWARDS, MASK, gamma)
    assert torch.equal(ret, raw)
    assert torch.allclose(adv, whiten(raw, MASK))
    assert adv[MASK].mean().abs().item() < 1e-6


def test_gae_advantages_whitened_returns_raw():
    adv, ret = compute_advantages("gae", REWARDS, MASK, values=VALUES, gamma=0.5, lambd=0.5)
    raw_adv, raw_ret = gae(REWARDS, VALUES, MASK, 0.5, 0.5)
    assert torch.equal(ret, raw_ret)
    assert torch.allclose(adv, whiten(raw_adv, MASK))


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo"])
def test_unwhitened_group_estimators(estimator):
    adv, ret = compute_advantages(estimator, REWARDS, MASK)
    assert torch.equal(adv, ret)
    assert adv.data_ptr() != ret.data_ptr()  # a copy: editing advantages leaves returns alone


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages("gae", REWARDS, MASK)
    with pytest.raises(ValueError, match="--gamma 1.0"):
        compute_advantages("rloo", REWARDS, MASK, gamma=0.9)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", REWARDS, MASK)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_group_baseline_follows_the_registry(estimator):
    """Estimators without a baseline in algo/registry.py leave the scores as they are; the others centre each group."""
    out = group_baseline(SCORES, 3, estimator)
    if ESTIMATORS[estimator].baseline is None:
        assert torch.equal(out, SCORES)
    elif ESTIMATORS[estimator].needs_groups:
        assert out.reshape(-1, 3).sum(dim=1).abs().max() < 1e-5  # every group baseline centres its group
    else:
        assert out.sum().abs() < 1e-5  # a batch baseline centres the batch


# --- flash_reinforce: OpenRLHF 0.11.2's batch-mean estimator -----------------------------------------------------


def test_flash_reinforce_centres_the_batch_not_the_groups():
    # SCORES mean 12 / 6 = 2: [1-2, 2-2, 6-2, 0-2, 0-2, 3-2], the same for any group size (1 sample per prompt too)
    for n in (1, 3, 6):
        assert group_baseline(SCORES, n, "flash_reinforce").tolist() == pytest.approx([-1.0, 0.0, 4.0, -2.0, -2.0, 1.0])
    spec = ESTIMATORS["flash_reinforce"]
    assert not spec.needs_critic and not spec.needs_groups and spec.whole_response and not spec.whiten


# Golden numbers: OpenRLHF 0.11.2's RemoteExperienceMaker.compute_advantages_and_returns (the PyPI wheel
# openrlhf-0.11.2, trainer/ppo_utils/experience_maker.py, loaded with its own tests' stubs for ray and vllm) on these
# inputs, run once with n_samples_per_prompt 1 and 5 (both gave these numbers), kl_ctl 0.1, clip range (-10, 10).
# By hand: the scores' mean is 0.6, so the centred scores are [0.4, -0.6, -0.1, 1.4, -1.1]; row 0's rewards are
# -0.1 * [0.1, 0.2, 0.3] with 0.4 added on its last token, and its returns (gamma 1) [0.34, 0.35, 0.37]; no whitening.
FLASH_SCORES = torch.tensor([1.0, 0.0, 0.5, 2.0, -0.5])
FLASH_MASK = mask([1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0])
FLASH_KL = t([0.1, 0.2, 0.3], [0.0, -0.1, 0.0], [0.5, 0.0, 0.0], [0.2, 0.2, 0.2], [0.1, 0.0, 0.0])
FLASH_0112 = [
    [0.3399999737739563, 0.34999996423721313, 0.3699999749660492],
    [-0.5900000333786011, -0.5900000333786011, 0.0],
    [-0.15000002086162567, 0.0, 0.0],
    [1.340000033378601, 1.3600000143051147, 1.3799999952316284],
    [-1.1100000143051147, -1.100000023841858, 0.0],
]


@pytest.mark.parametrize("n", [1, 5])
def test_flash_reinforce_matches_openrlhf_0_11_2(n):
    scores = group_baseline(FLASH_SCORES, n, "flash_reinforce")
    rewards = shape_rewards(scores, FLASH_KL * FLASH_MASK, FLASH_MASK, 0.1, (-10.0, 10.0))
    adv, ret = compute_advantages("flash_reinforce", rewards, FLASH_MASK)
    close(adv, FLASH_0112)
    close(ret, FLASH_0112)
    with pytest.raises(ValueError, match="--gamma 1.0"):
        compute_advantages("flash_reinforce", rewards, FLASH_MASK, gamma=0.9)


# --- KL controllers ------------------------------------------------------------------------------------------------


def test_adaptive_kl_controller_hand_numbers():
    ctl = AdaptiveKLController(init_kl_coef=0.1, kl_target=6.0, kl_horizon=10000)
    # kl 9: err = 9/6 - 1 = 0.5 -> clipped 0.2; mult = 1 + 0.2 * 1000 / 10000 = 1.02 -> 0.102
    ctl.update(9.0, 1000)
    assert ctl.value == pytest.approx(0.102)
    # kl 5.4: err = 0.9 - 1 = -0.1; mult = 1 - 0.1 * 2000 / 10000 = 0.98 -> 0.09996
    ctl.update(5.4, 2000)
    assert ctl.value == pytest.approx(0.09996)
    # kl 0: err = -1 -> clipped -0.2; mult = 1 - 0.2 * 0.1 = 0.98 -> 0.0979608
    ctl.update(0.0, 1000)
    assert ctl.value == pytest.approx(0.0979608)


def test_adaptive_kl_never_negative():
    # horizon 100, n_steps 1000, kl 0: mult = 1 - 0.2 * 10 = -1 -> floored at 0
    ctl = AdaptiveKLController(0.1, 1.0, 100)
    ctl.update(0.0, 1000)
    assert ctl.value == 0.0


def test_fixed_kl_and_factory():
    ctl = make_kl_controller(0.05, None, 10000)
    assert isinstance(ctl, FixedKLController)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    assert isinstance(make_kl_controller(0.05, 6.0, 10000), AdaptiveKLController)


def test_kl_controller_state_dict_round_trip():
    a = AdaptiveKLController(0.1, 6.0, 10000)
    a.update(9.0, 1000)  # 0.102
    b = AdaptiveKLController(0.1, 6.0, 10000)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value == pytest.approx(0.102)
    f = FixedKLController(0.05)
    f.load_state_dict(FixedKLController(0.05).state_dict())
    assert f.value == 0.05
    with pytest.raises(ValueError, match="--kl_target"):
        b.load_state_dict(f.state_dict())


# --- running moments -----------------------------------------------------------------------------------------------


def test_running_moments_hand_numbers():
    rm = RunningMoments()
    assert rm.normalize(torch.tensor([2.0])).item() == pytest.approx(2.0)  # nothing seen: mean 0, std 1
    # [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    assert rm.update(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx((2.0, 1.0))
    # + [5]: [1, 2, 3, 5] mean 11/4 = 2.75, deviations [-1.75, -0.75, 0.25, 2.25],
    # squares 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75, unbiased var 8.75 / 3 = 2.916667
    mean, std = rm.update(torch.tensor([5.0]))
    assert (mean, std) == pytest.approx((2.75, math.sqrt(8.75 / 3)))
    assert rm.normalize(torch.tensor([2.75 + std])).item() == pytest.approx(1.0, abs=1e-6)


def test_running_moments_match_torch_over_concatenation():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 3 + 1 for n in (3, 1, 7, 0, 5)]
    rm = RunningMoments()
    for b in batches:
        rm.update(b)
    allx = torch.cat(batches).double()
    assert rm.count == 16
    assert rm.mean == pytest.approx(allx.mean().item(), abs=1e-12)
    assert rm.std == pytest.approx(allx.std().item(), abs=1e-12)  # torch.std: unbiased

    resumed = RunningMoments()
    resumed.load_state_dict(rm.state_dict())
    extra = torch.tensor([10.0, -4.0])
    assert resumed.update(extra) == pytest.approx(rm.update(extra))
