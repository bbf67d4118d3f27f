"""The numbers a PPO step reports from its trainers' results: rank-averaged train stats and the engine gap.

    mean_stats([TrainStats per rank and micro-step])  -> {field: mean}, plus the `extra` keys every rank reported
    engine_gap(engine_lp, old_lp, action_mask, actor)  -> mean |engine log-prob - trainer log-prob| per action token
    step_row(info, actor, critic, fields, ppo)          -> the step's metrics row (metrics.jsonl), in its order

The engine gap is how far the vLLM engines' sampling log-probs are from the policy being trained (trainer/sync_guard.py
stops a run whose engines diverge). With an old-log-prob forward it is measured here; on a single pass
(--max_epochs 1 and one optimizer step: no such forward) the actor measured it in its training forward and
reports sums and token counts, averaged alike over ranks and micro-batches, so their ratio is exact.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

import torch

from orlhf.types import TrainStats

# The actor's metrics on a --freezing_actor_steps step: no training, so none (NaN: metrics.jsonl writes null).
FROZEN_ACTOR_STATS: dict[str, float] = {
    k: float("nan")
    for k in (
        "loss",
        "lr",
        "clip_frac",
        "clip_frac_low",
        "clip_frac_high",
        "approx_kl",
        "entropy",
        "grad_norm",
        "kl_loss",
        "kl_coef",
        "is_cut_frac",
    )
}


def mean_stats(stats: list[TrainStats]) -> dict[str, float]:
    keys = [f.name for f in fields(TrainStats) if f.name != "extra"]
    out = {k: sum(float(getattr(s, k)) for s in stats) / len(stats) for k in keys}
    extra = set.intersection(*(set(s.extra) for s in stats)) if stats else set()  # reported by every rank
    return {**out, **{k: sum(float(s.extra[k]) for s in stats) / len(stats) for k in extra if k not in out}}


def engine_gap(
    engine_lp: torch.Tensor, old_lp: Optional[torch.Tensor], mask: torch.Tensor, actor: Optional[dict] = None
) -> float:
    """Mean |engine log-prob - trainer log-prob| per action token: against `old_lp` when there is one, else from
    the sums the actor's training forward reported (`actor`: mean_stats of its TrainStats)."""
    if old_lp is not None:
        return (engine_lp - old_lp).abs().mul(mask).sum().item() / max(1, int(mask.sum()))
    return actor["engine_gap_sum"] / max(1.0, actor["engine_gap_tokens"])


def step_row(info: dict, actor: dict, critic: Optional[dict], fields: dict, ppo) -> dict:
    """A step's metrics row: make_experience's `info`, the actor's mean train stats, the controller's `fields`
    (versions, gap, samples, rewards, timings, agents' metrics), then the KL loss and its coefficient, the IS cut
    fraction and the critic's stats where the run has them (`ppo`: its PPO config section)."""
    row = {
        **info,
        "policy_loss": actor["loss"],
        "actor_lr": actor["lr"],
        "clip_frac": actor["clip_frac"],
        "approx_kl": actor["approx_kl"],
        **{k: actor[k] for k in ("clip_frac_low", "clip_frac_high", "entropy")},
        "actor_grad_norm": actor["grad_norm"],
        **fields,
    }
    if ppo.use_kl_loss:
        row.update(kl_loss=actor["kl_loss"], kl_coef=actor["kl_coef"])  # the coefficient used
    if ppo.is_correction_enabled:
        row["is_cut_frac"] = actor["is_cut_frac"]
    if critic is not None:
        row.update(
            value_loss=critic["loss"],
            critic_lr=critic["lr"],
            value_clip_frac=critic["clip_frac"],
            critic_grad_norm=critic["grad_norm"],
        )
    return row
