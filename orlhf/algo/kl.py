"""KL estimators between the policy and the reference on sampled tokens (Schulman, "Approximating KL").

With log r = log pi(a|s) - log pi_ref(a|s) for a token a sampled from pi:
    k1 = log r                        unbiased for KL(pi || ref), high variance, can be negative
    k2 = (log r)^2 / 2                biased, always >= 0, low variance
    k3 = exp(-log r) - 1 + log r      unbiased for KL(pi || ref) and always >= 0 (r_ref/pi - 1 - log(r_ref/pi))
Sign convention: positive log r means the policy is more confident than the reference on that token.

Where this departs from OpenRLHF's compute_approx_kl: OpenRLHF clamps the *estimate* to [-10, 10]; here log r is
clamped to [-10, 10] *before* the estimator, so k3's exp cannot overflow (exp(10) ~ 2.2e4 is the largest term).
The two agree whenever |log r| stays small, which is the regime PPO works in.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 10.0


def approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate, (B, A) float32. Padding positions are not masked here: mask downstream."""
    log_ratio = (log_probs.float() - ref_log_probs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return log_ratio.square() / 2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
