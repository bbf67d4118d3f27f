"""The numbers a PPO step reports from its trainers' results: rank-averaged train stats and the engine gap.

    mean_stats([TrainStats per rank and micro-step])  -> {field: mean}, plus the `extra` keys every rank reported
    engine_gap(engine_lp, old_lp, action_mask, actor)  -> mean |engine log-prob - trainer log-prob| per action token
    step_row(info, actor, critic, fields, ppo)          -> the step's metrics row (metrics.jsonl), in its order
    StepCheck: before_train(step, gap), after_train(step, actor, critic, gap)
                                                        -> NonFiniteError on a NaN / infinite loss, gradient norm
                                                           or gap; CollapsedError when the updates stalled twice

A diverged update (a learning rate far too large) shows as NaN or infinite losses, gradient norms or engine gaps;
averaged, logged (metrics.jsonl writes null) and compared (NaN > threshold is false) they would pass unnoticed while
the weights are pushed to the engines, checkpointed and exported. The controller checks them before the score's
numbers reach training and before the update reaches the engines, so nothing non-finite goes any further.

The engine gap is how far the vLLM engines' sampling log-probs are from the policy being trained (trainer/sync_guard.py
stops a run whose engines diverge). With an old-log-prob forward it is measured here; on a single pass
(--max_epochs 1 and one optimizer step: no such forward) the actor measured it in its training forward and
reports sums and token counts, averaged alike over ranks and micro-batches, so their ratio is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
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
    if ppo.router_replay != "disabled" and "routing_tokens" in actor:  # not on a frozen actor's step
        # tokens scoring the response (the last prompt token, the response's but its last) routed to recorded
        # experts, and the share of them whose experts the routers would have chosen otherwise in some layer
        row["routing_replayed_frac"] = actor["routing_tokens"] / max(1.0, actor["routing_response_tokens"])
        row["routing_mismatch_frac"] = actor["routing_differ_sum"] / max(1.0, actor["routing_tokens"])
    if critic is not None:
        row.update(
            value_loss=critic["loss"],
            critic_lr=critic["lr"],
            value_clip_frac=critic["clip_frac"],
            critic_grad_norm=critic["grad_norm"],
        )
    return row


def stalled(actor: dict) -> bool:
    """A gradient of exactly 0 under a loss that is not 0, with tokens left unclipped: after too large an update the
    policy saturates (its gradient vanishes, or overflows and DeepSpeed skips the step) and learns nothing more. A
    healthy step with nothing to learn (every advantage 0, e.g. GRPO groups of equal rewards) has a loss of 0, and a
    step whose every token is clipped has clip_frac 1: neither is this. grad_norm is the last optimizer step's and
    the loss a mean over all of them, so a last mini-batch of zero advantages can pass once: StepCheck warns only
    when two steps in a row stall."""
    return actor["grad_norm"] == 0.0 and actor["loss"] != 0.0 and actor["clip_frac"] < 1.0


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or engine gap is NaN or infinite: the run stops before those weights go anywhere."""


class CollapsedError(RuntimeError):
    """The actor's updates vanished two steps in a row (stalled): the policy collapsed and learns nothing more, so
    the run stops (exit 1) instead of training on and exporting it as a finished run."""


@dataclass
class StepCheck:
    """Stops a run whose numbers left the finite (module docstring), or whose actor's updates stalled two steps in a
    row (`stalled`). The learning rates name the fix."""

    actor_lr: float
    critic_lr: float
    stalled_last: bool = False  # the previous step's actor stalled

    def before_train(self, step: int, gap: float) -> None:
        """`gap` measured against the actor's old log-probs, before anything trains on this batch."""
        if not math.isfinite(gap):
            raise NonFiniteError(
                self.explain(
                    step,
                    {"engine_logprob_gap": gap},
                    "before training (the actor's log-probs of the samples are not finite)",
                )
            )

    def after_train(self, step: int, actor: Optional[dict], critic: Optional[dict], gap: float) -> None:
        """After the train phase, before the sync. actor: its mean stats, None when it sat out (frozen: its stats
        and gap are NaN by design)."""
        values = {}
        if actor is not None:
            values = {
                "policy_loss": actor["loss"],
                "actor_grad_norm": actor["grad_norm"],
                "entropy": actor["entropy"],
                "kl_loss": actor["kl_loss"],
                "engine_logprob_gap": gap,
            }
        if critic is not None:
            values.update(value_loss=critic["loss"], critic_grad_norm=critic["grad_norm"])
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if bad:
            raise NonFiniteError(self.explain(step, bad, "in training"))
        was, self.stalled_last = self.stalled_last, actor is not None and stalled(actor)
        if was and self.stalled_last:  # twice in a row: one step may have had nothing to learn
            raise CollapsedError(
                f"step {step}: the actor's gradient norm is exactly 0 while its loss is not ({actor['loss']:.3g}), as "
                "on the step before: its updates vanish (or overflow and are skipped), so the policy collapsed and "
                "learns nothing more; the run stops here, before these weights reach the engines, a checkpoint or "
                f"the export. The updates were too large: train again with a lower --actor_learning_rate (now "
                f"{self.actor_lr:g})."
            )

    def explain(self, step: int, bad: dict[str, float], when: str) -> str:
        shown = ", ".join(f"{k} {v}" for k, v in bad.items())
        critic = [k for k in bad if k.startswith(("value", "critic"))]
        lrs = ([] if len(critic) == len(bad) else [f"--actor_learning_rate (now {self.actor_lr:g})"]) + (
            [f"--critic_learning_rate (now {self.critic_lr:g})"] if critic else []
        )
        return (
            f"step {step}: {shown} {when}: the updates diverged, so the run stops before these weights reach the "
            f"engines, a checkpoint or the export. Train again with a lower {' and '.join(lrs)}."
        )
