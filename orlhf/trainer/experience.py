"""Rollouts + model outputs -> Experience.

[Rollout] --rollouts_to_batch--> SequenceBatch (+ engine log-probs, rewards' text inputs)
SequenceBatch --ref/critic/reward/actor groups--> log-probs, values, scores
--> length penalties on the scores (DAPO overlong, stop-properly) --> group baseline
--> KL-shaped rewards, advantages, returns (algo/) --> Experience
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from orlhf.algo.advantages import compute_advantages
from orlhf.algo.kl import approx_kl, make_kl_controller
from orlhf.algo.losses import masked_mean
from orlhf.algo.rewards import group_baseline, overlong_penalty, shape_rewards, stop_properly_penalty
from orlhf.types import Experience, Rollout, SequenceBatch, VisionRows


def rollouts_to_batch(rollouts: list[Rollout], pad_id: int) -> tuple[SequenceBatch, torch.Tensor]:
    """Pad rollouts into one batch: prompts left-padded to the longest prompt, responses right-padded to the
    longest response. Returns the batch and the engine's log-probs (B, A), 0 on padding.
    A multi-turn rollout's feedback tokens are real tokens (attention 1) but no actions (action_mask 0).

    An empty response keeps one padded action slot with action_mask 0, so A >= 1 always.
    """
    if not rollouts:
        raise ValueError("no rollouts to batch")
    P = max(len(r.prompt_ids) for r in rollouts)
    A = max(1, max(len(r.response_ids) for r in rollouts))
    B = len(rollouts)
    seq = torch.full((B, P + A), pad_id, dtype=torch.long)
    attn = torch.zeros(B, P + A, dtype=torch.long)
    action_mask = torch.zeros(B, A, dtype=torch.bool)
    logprobs = torch.zeros(B, A, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        seq[i, P - p : P] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attn[i, P - p : P] = 1
        if n:
            seq[i, P : P + n] = torch.tensor(r.response_ids, dtype=torch.long)
            attn[i, P : P + n] = 1
            action_mask[i, :n] = True if r.action_mask is None else torch.tensor(r.action_mask[:n]).bool()
            logprobs[i, :n] = torch.tensor(r.logprobs[:n], dtype=torch.float32)
    vision = VisionRows([r.vision for r in rollouts]) if any(r.vision is not None for r in rollouts) else None
    return SequenceBatch(seq, attn, action_mask, vision, routing_of(rollouts, P + A)), logprobs


def routing_of(rollouts: list[Rollout], t: int) -> Optional[torch.Tensor]:
    """(B, T, L, K) int16 --router_replay R3: each rollout's routed experts at its tokens' columns (prompt left-padded
    to T - A, response after it), -1 where none was recorded; None when no rollout has any."""
    found = [r.routed_experts for r in rollouts if r.routed_experts is not None]
    if not found:
        return None
    out = torch.full((len(rollouts), t, *found[0].shape[1:]), -1, dtype=torch.int16)
    p = t - max(1, max(len(r.response_ids) for r in rollouts))
    for i, r in enumerate(rollouts):
        if r.routed_experts is not None:
            start = p - len(r.prompt_ids)
            rows = r.routed_experts[: t - start]
            out[i, start : start + rows.shape[0]] = rows
    return out


@dataclass(frozen=True)
class ExperienceConfig:
    """The PPO-math slice of the config: how scores and log-probs become advantages."""

    advantage_estimator: str = "gae"
    n_samples_per_prompt: int = 1
    kl_estimator: str = "k1"
    use_kl_loss: bool = False  # KL goes into the actor's loss instead of the reward
    reward_clip_range: tuple = (-10.0, 10.0)
    gamma: float = 1.0
    lambd: float = 1.0
    std_norm: bool = True  # not --no_advantage_std_norm
    generate_max_len: int = 1024
    overlong_buffer_len: Optional[float] = None
    overlong_penalty_factor: float = 1.0
    stop_properly_penalty_coef: Optional[float] = None
    keep_rollout_log_probs: bool = False  # --enable_vllm_is_correction: the actor needs the engine's log-probs

    @classmethod
    def from_ppo(cls, ppo) -> "ExperienceConfig":
        return cls(
            ppo.advantage_estimator,
            ppo.n_samples_per_prompt,
            ppo.kl_estimator,
            ppo.use_kl_loss,
            tuple(ppo.reward_clip_range),
            ppo.gamma,
            ppo.lambd,
            not ppo.no_advantage_std_norm,
            ppo.generate_max_len,
            ppo.overlong_buffer_len,
            ppo.overlong_penalty_factor,
            ppo.stop_properly_penalty_coef,
            ppo.is_correction_enabled,
        )


def length_penalties(
    scores: torch.Tensor, lengths: torch.Tensor, truncated: Optional[torch.Tensor], cfg: ExperienceConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scores (B,) after the DAPO overlong and the stop-properly penalties (OpenRLHF's order: overlong first)."""
    info: dict[str, float] = {}
    if cfg.overlong_buffer_len is not None:
        pen = overlong_penalty(lengths, cfg.generate_max_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        scores = scores.float() + pen
        info["overlong_penalized_share"] = (pen < 0).float().mean().item()
    if cfg.stop_properly_penalty_coef is not None and truncated is not None:
        scores = stop_properly_penalty(scores, truncated, cfg.stop_properly_penalty_coef)
        info["truncated_share"] = truncated.float().mean().item()
    return scores, info


def make_experience(
    batch: SequenceBatch,
    scores: torch.Tensor,
    old_log_probs: Optional[torch.Tensor],
    ref_log_probs: Optional[torch.Tensor],
    values: Optional[torch.Tensor],
    kl_coef: float,
    cfg: ExperienceConfig,
    weight_version: int = 0,
    truncated: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
) -> tuple[Experience, dict[str, float]]:
    """One step's scored rollouts -> an Experience batch and its summary numbers.

    scores (B,) task rewards (already normalized if --normalize_reward); log-probs and values (B, A);
    truncated (B,) bool: responses cut at --generate_max_len; rollout_log_probs (B, A): the engine's.
    Order (algo/advantages.py's contract): scores -> group baseline -> KL-shaped per-token rewards -> advantages.
    Skipped forwards: ref_log_probs None (no reference model) gives KL 0; old_log_probs None (a single pass) is
    allowed only when no KL is shaped into the rewards, and the "kl" figure then reads the engines' log-probs.
    """
    mask = batch.action_mask
    kl = _kl(old_log_probs, ref_log_probs, rollout_log_probs, kl_coef, cfg) * mask  # (B, A)
    scores, penalty_info = length_penalties(scores, mask.sum(-1), truncated, cfg)
    baselined = group_baseline(scores, cfg.n_samples_per_prompt, cfg.advantage_estimator)  # (B,)
    rewards = shape_rewards(baselined, kl, mask, 0.0 if cfg.use_kl_loss else kl_coef, cfg.reward_clip_range)
    advantages, returns = compute_advantages(
        cfg.advantage_estimator, rewards, mask, values=values, gamma=cfg.gamma, lambd=cfg.lambd, std_norm=cfg.std_norm
    )
    exp = Experience(
        batch.sequences,
        batch.attention_mask,
        mask,
        action_log_probs=old_log_probs,
        advantages=advantages,
        returns=returns if values is not None else None,
        values=values,
        base_action_log_probs=ref_log_probs if cfg.use_kl_loss else None,
        weight_version=weight_version,
        # engine log-probs: for IS correction, and for the engine gap on a single pass
        rollout_log_probs=rollout_log_probs if cfg.keep_rollout_log_probs or old_log_probs is None else None,
        vision=batch.vision,
        routing=batch.routing,  # --router_replay: the experts the actor's training forwards route to
    )
    lengths = mask.sum(-1).clamp(min=1).float()
    info = {
        "reward_mean": scores.mean().item(),
        "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
        "kl": ((kl.sum(-1) / lengths).mean()).item(),  # per-token KL, averaged per sequence
        "response_length": mask.sum(-1).float().mean().item(),
        "advantage_abs_mean": masked_mean(advantages.abs(), mask).item(),
        **penalty_info,
    }
    if values is not None:
        info["value_mean"] = masked_mean(values, mask).item()
        info["return_mean"] = masked_mean(returns, mask).item()
    return exp, info


class ExperienceMaker:
    """The make_experience phase of the controller's step, with what it keeps across steps: the KL controller (fixed,
    or adaptive with --kl_target), whose coefficient shapes this step's rewards before it moves for the next one."""

    def __init__(self, ppo):
        self.cfg = ExperienceConfig.from_ppo(ppo)
        self.kl_ctl = make_kl_controller(ppo.init_kl_coef, ppo.kl_target, ppo.kl_horizon)

    def make(
        self, batch, scores, old_lp, ref_lp, values, norm=None, weight_version=0, truncated=None, engine_log_probs=None
    ) -> tuple[Experience, dict]:
        """make_experience on `scores` normalized by `norm` (--normalize_reward's statistics, or None).
        info["kl_coef"] is the KL coefficient of this step (reward penalty, or the actor's KL loss), taken before the
        adaptive controller moves it for the next step (OpenRLHF's order); info["reward_mean"] the raw task reward,
        whatever the normalization."""
        shaped_scores = norm.normalize(scores) if norm is not None else scores
        kl_coef = self.kl_ctl.value
        exp, info = make_experience(
            batch,
            shaped_scores,
            old_lp,
            ref_lp,
            values,
            kl_coef,
            self.cfg,
            weight_version=weight_version,
            truncated=truncated,
            rollout_log_probs=engine_log_probs,
        )
        info["reward_mean"] = scores.mean().item()
        info["kl_coef"] = kl_coef
        self.kl_ctl.update(info["kl"], len(scores))
        return exp, info


def _kl(old_log_probs, ref_log_probs, rollout_log_probs, kl_coef: float, cfg: ExperienceConfig) -> torch.Tensor:
    """(B, A) per-token KL(policy || ref) estimate; zeros without a reference model."""
    if ref_log_probs is None:
        if cfg.use_kl_loss:
            raise ValueError("--use_kl_loss needs the reference log-probs")
        return torch.zeros_like(old_log_probs if old_log_probs is not None else rollout_log_probs)
    if old_log_probs is None:
        if kl_coef != 0 and not cfg.use_kl_loss:
            raise ValueError("a KL-shaped reward needs the old log-probs (TrainConfig.single_pass is False here)")
        if rollout_log_probs is None:
            raise ValueError("without old log-probs the KL figure needs the engines' log-probs")
        return approx_kl(rollout_log_probs, ref_log_probs, cfg.kl_estimator)  # a figure only: coefficient 0
    return approx_kl(old_log_probs, ref_log_probs, cfg.kl_estimator)
