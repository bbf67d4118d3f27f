"""PPO losses (OpenRLHF semantics): per-token terms, then one aggregation over the whole optimizer step.

    policy (ppo):   log r = clamp(log pi - log pi_old, -20, 20)        (clamped before exp, as OpenRLHF)
                    ratio = exp(log r)
    policy (gspo):  ratio = exp(clamp(mean_t(log pi - log pi_old), -20, 20)), one per sequence (GSPO, arXiv
                    2507.18071: the geometric mean of the token ratios), broadcast to its tokens
                    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
                    dual clip (c > 1, Ye et al. 2020), only where A < 0: loss_t = min(loss_t, -c * A)
    IS correction (ppo; algo/is_correction.py): w = exp(log pi_old - log pi_engine), no gradient; a statistic s per
                    unit (a token, or a sequence: the masked mean) is gated to [low, high]
                    s = w (ratio; per sequence exp(mean_t log w)), or with p = pi_engine(a), q = pi_old(a) of the
                    sampled token, both clamped to [1e-6, 1 - 1e-6]:
                        binary_kl  p log(p / q) + (1 - p) log((1 - p) / (1 - q))      tv  |p - q|
                    mask          loss_t *= w if low <= s <= high else 0     (icepop: token ratio; seq-mask-tis: seq)
                    clip          loss_t *= clamp(w, low, high)              (tis; token level, ratio gating only)
                    (gspo uses the engine log-probs in its sequence ratio instead: log pi - log pi_engine)
    value:          v_clip = v_old + clip(v - v_old, -eps_v, eps_v)
                    loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2);   eps_v None -> 0.5 * (v - R)^2

Aggregation (aggregate): token_mean (default) = sum of every real token's loss / number of real tokens;
seq_mean = mean over sequences of each sequence's token mean. With a LossNorm the denominator is the whole
optimizer step's count (every micro-batch of the step, every data-parallel rank) and `scale` undoes DeepSpeed's
1/grad-accumulation scaling and its average over ranks, so one optimizer step's gradient is the gradient of the
whole batch's loss computed at once (OpenRLHF >= 0.11's aggregate_loss). Without a norm it is a local mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from orlhf.algo.is_correction import IS_CORRECTION_TYPES as IS_CORRECTION_TYPES  # re-exported for the config test
from orlhf.algo.is_correction import IsCorrection

LOSS_AGG_MODES = ("token_mean", "seq_mean")
POLICY_LOSS_TYPES = ("ppo", "gspo")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: finite in float32; OpenRLHF's bound before exp
PROB_CLAMP = 1e-6  # the divergence gates' probabilities lie in [1e-6, 1 - 1e-6]: binary_kl's logs stay finite


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x over positions where mask is true: over everything (dim None) or along `dim`.

    An all-false mask gives 0 rather than NaN (a rank may get a micro-batch whose responses are all empty).
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


@dataclass(frozen=True)
class LossNorm:
    """Denominators of one optimizer step, counted over all its micro-batches and all data-parallel ranks."""

    tokens: float  # real action tokens
    seqs: float  # sequences with at least one real action token
    scale: float = 1.0  # grad-accumulation steps x DP ranks (DeepSpeed divides by the first, averages the second)


def step_norm(masks: list[torch.Tensor], scale: float = 1.0) -> LossNorm:
    """A LossNorm from the action masks (b, A) of one optimizer step's micro-batches on this rank.

    Sum the result over ranks (tokens and seqs) before use: the worker does that with one all-reduce.
    """
    tokens = sum(float(m.sum()) for m in masks)
    seqs = sum(float((m.sum(-1) > 0).sum()) for m in masks)
    return LossNorm(tokens, seqs, scale)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", norm: Optional[LossNorm] = None
) -> torch.Tensor:
    """(B, A) per-token values -> scalar: token_mean or seq_mean (module docstring); empty rows never count."""
    m = mask.to(per_token.dtype)
    if mode == "token_mean":
        if norm is None:
            return masked_mean(per_token, mask)
        return (per_token * m).sum() / max(norm.tokens, 1.0) * norm.scale
    if mode == "seq_mean":
        counts = m.sum(-1)
        seq = (per_token * m).sum(-1) / counts.clamp(min=1.0)  # (B,) each sequence's token mean
        nonempty = (counts > 0).to(per_token.dtype)
        if norm is None:
            return (seq * nonempty).sum() / nonempty.sum().clamp(min=1.0)
        return (seq * nonempty).sum() / max(norm.seqs, 1.0) * norm.scale
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGG_MODES}")


@dataclass
class PolicyLossTerms:
    """The policy loss of a micro-batch before aggregation, and where clipping / IS correction bit."""

    loss: torch.Tensor  # (B, A) per-token loss (IS weights applied); aggregate() it
    clipped_low: torch.Tensor  # (B, A) bool: A < 0 and ratio < 1 - eps_low, the clipped branch taken
    clipped_high: torch.Tensor  # (B, A) bool: A > 0 and ratio > 1 + eps_high, the clipped branch taken
    dual_clipped: torch.Tensor  # (B, A) bool: the dual clip's bound taken (A < 0, ratio > c)
    is_cut: Optional[torch.Tensor] = None  # (B, A) bool: IS weight clipped, or the token's unit masked out


def policy_loss_terms(
    log_probs: torch.Tensor,  # (B, A) log pi(a|s), with grad
    old_log_probs: torch.Tensor,  # (B, A) log pi_old(a|s): the trainer's policy that made the experience
    advantages: torch.Tensor,  # (B, A)
    action_mask: torch.Tensor,  # (B, A) bool
    eps_low: float,
    eps_high: float,
    dual_clip: Optional[float] = None,
    loss_type: str = "ppo",
    rollout_log_probs: Optional[torch.Tensor] = None,  # (B, A) the engine's log-probs, for IS correction
    is_correction: Optional[IsCorrection] = None,  # None: no IS correction
) -> PolicyLossTerms:
    """Per-token clipped surrogate loss (to minimize), with the variants of the module docstring."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if is_correction is not None and rollout_log_probs is None:
        raise ValueError("IS correction needs the engine's log-probs (Experience.rollout_log_probs)")
    mask = action_mask.bool()
    if loss_type == "ppo":
        ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    elif loss_type == "gspo":
        base = rollout_log_probs if is_correction is not None else old_log_probs
        seq_log_ratio = masked_mean(log_probs - base, mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = seq_log_ratio.exp().unsqueeze(-1) * mask  # (B, A): the sequence's ratio on each of its tokens
    else:
        raise ValueError(f"unknown policy loss type {loss_type!r}; expected one of {POLICY_LOSS_TYPES}")
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    objective = torch.min(surr1, surr2)
    clipped = (surr2 < surr1) & mask
    dual = torch.zeros_like(mask)
    if dual_clip is not None:
        # For A < 0 the PPO objective is unbounded below as ratio grows; the dual clip bounds it at c * A.
        bound = dual_clip * advantages
        dual = (advantages < 0) & (bound > objective) & mask
        objective = torch.where(advantages < 0, torch.max(objective, bound), objective)
    loss = -objective
    is_cut = None
    if is_correction is not None and loss_type == "ppo":
        loss, is_cut = _is_correct(loss, old_log_probs, rollout_log_probs, mask, is_correction)
    return PolicyLossTerms(loss, clipped & (advantages < 0), clipped & (advantages > 0), dual, is_cut)


def _is_correct(loss, old_log_probs, rollout_log_probs, mask, spec: IsCorrection):
    """Weight each token's loss by the gated trainer/engine ratio (module docstring); no gradient.
    Returns the weighted (B, A) loss and (B, A) bool: where the weight was clipped or the token's unit masked."""
    low, high = spec.threshold
    log_w = (old_log_probs - rollout_log_probs).detach()  # (B, A) log(pi_old / pi_engine)
    w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    seq = spec.level == "seq"
    if spec.gating == "ratio":
        stat = masked_mean(log_w, mask, dim=-1).unsqueeze(-1) if seq else log_w  # (B, 1) or (B, A)
        stat = stat.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    else:
        stat = token_divergence(old_log_probs.detach(), rollout_log_probs.detach(), spec.gating)
        stat = masked_mean(stat, mask, dim=-1).unsqueeze(-1) if seq else stat
    if spec.mode == "clip":
        return loss * stat.clamp(low, high), ((stat < low) | (stat > high)) & mask
    keep = (stat >= low) & (stat <= high)
    return loss * torch.where(keep, w, torch.zeros_like(w)), ~keep & mask


def token_divergence(train_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """(B, A) divergence between the engine's and the trainer's probability of each sampled token, each read as a
    two-outcome distribution (the token, or not): binary_kl = KL(engine || trainer), or tv = |p - q|."""
    p = engine_log_probs.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = train_log_probs.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if kind == "binary_kl":
        return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    if kind == "tv":
        return (p - q).abs()
    raise ValueError(f"unknown divergence {kind!r}; expected binary_kl or tv")


def policy_loss(
    log_probs, old_log_probs, advantages, action_mask, eps_clip: float, dual_clip: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric PPO, local token mean: (loss, clip fraction incl. the dual clip), both scalars."""
    t = policy_loss_terms(log_probs, old_log_probs, advantages, action_mask, eps_clip, eps_clip, dual_clip)
    cut = (t.clipped_low | t.clipped_high | t.dual_clipped).float()
    return masked_mean(t.loss, action_mask), masked_mean(cut, action_mask).detach()


def value_loss_per_token(
    values: torch.Tensor, old_values: Optional[torch.Tensor], returns: torch.Tensor, value_clip: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) per-token clipped value loss (0.5 * max of squared errors) and (B, A) bool: clip bound."""
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    if old_values is None:
        raise ValueError("value_clip needs old_values (Experience.values)")
    values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (values_clipped - returns).square()
    return 0.5 * torch.max(unclipped, clipped), clipped > unclipped


def value_loss(
    values: torch.Tensor,  # (B, A) V(s), with grad
    old_values: Optional[torch.Tensor],  # (B, A) V_old(s) from experience making; needed when value_clip is set
    returns: torch.Tensor,  # (B, A) targets
    action_mask: torch.Tensor,  # (B, A) bool
    value_clip: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, local token mean, and clip fraction, both scalars."""
    loss, bound = value_loss_per_token(values, old_values, returns, value_clip)
    return masked_mean(loss, action_mask), masked_mean(bound.float(), action_mask).detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim: (..., V) -> (...), computed in float32."""
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)
