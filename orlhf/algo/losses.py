"""PPO losses: clipped policy loss and clipped value loss, both token-level masked means (OpenRLHF semantics).

Token-level means every real action token in the micro-batch weighs the same (sum over tokens / token count),
as OpenRLHF's default `token_level_loss`; long responses count more than short ones.

    policy:  ratio = exp(log pi - log pi_old)
             loss  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
             dual clip (c > 1, Ye et al. 2020), only where A < 0: loss = min(loss, -c * A)  (caps a huge ratio)
    value:   v_clip = v_old + clip(v - v_old, -eps_v, eps_v)
             loss   = 0.5 * max((v - R)^2, (v_clip - R)^2);   eps_v None -> 0.5 * (v - R)^2
clip_frac is the share of real tokens where the clipped branch is the one taken (it differs from the
unclipped one), i.e. where the gradient of that token is cut.
"""

from __future__ import annotations

from typing import Optional

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x over positions where mask is true: over everything (dim None) or along `dim`.

    An all-false mask gives 0 rather than NaN (a rank may get a micro-batch whose responses are all empty).
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def policy_loss(
    log_probs: torch.Tensor,  # (B, A) log pi(a|s), with grad
    old_log_probs: torch.Tensor,  # (B, A) log pi_old(a|s): the policy that made the experience
    advantages: torch.Tensor,  # (B, A)
    action_mask: torch.Tensor,  # (B, A) bool
    eps_clip: float,
    dual_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss (to minimize) and clip fraction, both scalars."""
    ratio = torch.exp(log_probs - old_log_probs)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_clip, 1 + eps_clip) * advantages
    clipped = torch.min(surr1, surr2)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        # For A < 0 the PPO objective is unbounded below as ratio grows; the dual clip bounds it at c * A.
        clipped = torch.where(advantages < 0, torch.max(clipped, dual_clip * advantages), clipped)
    loss = masked_mean(-clipped, action_mask)
    clip_frac = masked_mean((clipped != surr1).float(), action_mask)
    return loss, clip_frac.detach()


def value_loss(
    values: torch.Tensor,  # (B, A) V(s), with grad
    old_values: Optional[torch.Tensor],  # (B, A) V_old(s) from experience making; needed when value_clip is set
    returns: torch.Tensor,  # (B, A) targets
    action_mask: torch.Tensor,  # (B, A) bool
    value_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (0.5 * max of squared errors) and clip fraction, both scalars."""
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * masked_mean(unclipped, action_mask), torch.zeros((), device=values.device)
    if old_values is None:
        raise ValueError("value_clip needs old_values (Experience.values)")
    values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (values_clipped - returns).square()
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), action_mask)
    clip_frac = masked_mean((clipped > unclipped).float(), action_mask)
    return loss, clip_frac.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim: (..., V) -> (...), computed in float32."""
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)
