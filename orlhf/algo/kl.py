"""KL estimators between the policy and the reference on sampled tokens (Schulman, "Approximating KL").

With log r = log pi(a|s) - log pi_ref(a|s) for a token a sampled from pi:
    k1 = log r                        unbiased for KL(pi || ref), high variance, can be negative
    k2 = (log r)^2 / 2                biased, always >= 0, low variance
    k3 = exp(-log r) - 1 + log r      unbiased for KL(pi || ref) and always >= 0 (r_ref/pi - 1 - log(r_ref/pi))
Sign convention: positive log r means the policy is more confident than the reference on that token.

Every estimate is clamped to [-10, 10] after it is computed, as OpenRLHF's compute_approx_kl: at log r = -5, k3
is exp(5) - 1 - 5 = 142.4 unclamped and 10 here, so one wild token cannot dominate a shaped reward. k3 reads log r
bounded below at -10 (where it is past the cap already), as OpenRLHF 0.11.2: exp(-log r) cannot overflow, so the
KL loss's gradient there is 0, not 0 * inf = NaN.

Unbiased gradient (--kl_unbiased_gradient, OpenRLHF 0.11.2's --algo.kl.unbiased_gradient; KL as a loss only): the
value stays the estimator's, the gradient becomes w * log r * grad log pi with w = pi / pi_old (detached, at most
10), the importance-weighted score-function gradient of KL(pi || ref) on tokens sampled from pi_old. It is the
gradient of w * (log r)^2 / 2 (k2's pathwise gradient, reweighted), added as a straight-through term, so
k1/k2/k3 share it and differ only in the value. Unlike the estimate, the gradient is not clamped.

The KL controllers below own the coefficient of the KL penalty in the shaped reward: fixed, or adaptive towards
a target KL (make_kl_controller picks). Both save and restore through state_dict() for checkpoint resume.
"""

from __future__ import annotations

from typing import Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CLAMP = 10.0  # bound on the estimate, not on log r (OpenRLHF's)
KL_IS_WEIGHT_CLIP = 10.0  # largest pi / pi_old weight of the unbiased gradient (OpenRLHF 0.11.2's)


def approx_kl(
    log_probs: torch.Tensor,  # (B, A) log pi, with grad when KL is a loss
    ref_log_probs: torch.Tensor,  # (B, A) log pi_ref
    estimator: str = "k1",
    old_log_probs: Optional[torch.Tensor] = None,  # (B, A) log pi_old: the unbiased gradient's weight (None: w = 1)
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """Per-token KL estimate, (B, A) float32. Padding positions are not masked here: mask downstream."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio.square() / 2
    elif estimator == "k3":
        bounded = log_ratio.clamp(min=-KL_CLAMP)
        kl = torch.exp(-bounded) - 1 + bounded
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    kl = kl.clamp(-KL_CLAMP, KL_CLAMP)
    if not unbiased_gradient:
        return kl
    w = 1.0
    if old_log_probs is not None:
        w = (log_probs.float() - old_log_probs.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    surrogate = w * log_ratio.square() / 2
    # The value is kl's exactly (s - s.detach() is 0), the gradient is surrogate's.
    return kl.detach() + (surrogate - surrogate.detach())


# --- KL coefficient controllers -------------------------------------------------------------------------------
# The coefficient `value` multiplies the per-token KL in the shaped reward (orlhf/algo/rewards.py:shape_rewards),
# or, with --use_kl_loss, the KL term of the actor's loss: the controller passes the value to every train step.
# The controller calls update(kl, n_steps) once per rollout step with that step's mean KL and its sample count,
# as OpenRLHF's PPO trainer does (n_steps = rollout_batch_size * n_samples_per_prompt).


class FixedKLController:
    """A constant KL coefficient. update() does nothing.

    load_state_dict() keeps the configured coefficient: for a fixed controller the coefficient is configuration,
    not training state, so a resumed run with a different --init_kl_coef uses the new one as asked.
    """

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "fixed")


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593; OpenRLHF's AdaptiveKLController).

        err   = clip(current_kl / kl_target - 1, -0.2, 0.2)
        value = value * (1 + err * n_steps / kl_horizon)
    KL above target raises the penalty, below lowers it; one update moves it at most 20% * n_steps / horizon.

    Where this departs from OpenRLHF: the multiplier is floored at 0, so `value` can never turn negative when
    n_steps > 5 * kl_horizon (OpenRLHF would flip the penalty's sign there; with sane flags the two agree).
    """

    def __init__(self, init_kl_coef: float, kl_target: float, kl_horizon: int):
        if kl_target <= 0 or kl_horizon <= 0:
            raise ValueError(f"adaptive KL needs kl_target > 0 and kl_horizon > 0 (got {kl_target}, {kl_horizon})")
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon = int(kl_horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= max(1.0 + err * n_steps / self.horizon, 0.0)

    def state_dict(self) -> dict:
        # target and horizon are configuration (they come back from the flags); value is what the run learned.
        return {"kind": "adaptive", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "adaptive")
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(init_kl_coef: float, kl_target: float | None, kl_horizon: int) -> KLController:
    """Adaptive iff kl_target is given (OpenRLHF's rule), else fixed at init_kl_coef."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)


def _check_kind(state: dict, kind: str) -> None:
    if state.get("kind") != kind:
        raise ValueError(
            f"checkpoint holds a {state.get('kind')!r} KL controller but this run builds a {kind!r} one; "
            "resume with the same --kl_target setting (given for adaptive, left out for fixed)"
        )
