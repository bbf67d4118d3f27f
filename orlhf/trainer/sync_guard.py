"""The sync guard: stop a run whose engines sample from another policy than the one being trained.

Every step the controller has, for the same sampled tokens, the engine's log-probs (from generation) and the actor's
(scoring, before training). Their mean absolute gap per token (engine_logprob_gap) is the rounding of two kernel
stacks on the same weights while the sync works; a sync that missed weights (a tied head, a renamed or fused
tensor, a pre-packed copy vLLM did not refresh, a layer left out) or an engine behind the trainer adds the policy's
own movement to it, and PPO would then train on another policy's samples while the reward curve looks plausible.

How far rounding goes depends on the model, the dtype and the two kernel stacks (fp32 on CPU: rounding level;
bf16 with a large vocabulary: orders of magnitude more), so the threshold is calibrated on the run itself:

    first checked step    the engines loaded the model folder the actor loaded, and no sync has run yet: nothing
    (weight version 0)    the sync could break is there, so their gap h is this model's healthy gap on these
                          kernels and dtype ("sync guard: healthy engine gap ... at step 1 ...", one line)
                          h > CEILING[engines' dtype]: the run stops (EngineMismatchError): they disagree before
                          any sync (vLLM reads the folder otherwise than transformers: a weight it does not load, a
                          config field it misreads), and calibrating on that would hide it
                          else threshold = MULTIPLE * h + FLOOR
    every later check     gap > threshold: the run stops before training on those samples
    checkpoint            h and the threshold are saved (state_dict); a resume keeps them, since its first step
                          follows a sync (run_state.resume) and would calibrate on a broken one. A checkpoint without
                          them (saved before the first check, or on other kernels: --device / --bf16 differ) gives
                          the ceiling as threshold, said in one line.

The margin. MULTIPLE covers the healthy gap's drift as the policy trains (sharper or flatter distributions round
differently). FLOOR is for gaps at rounding level (fp32), where a multiple alone would give a threshold that a change
of kernel path could cross, or a path whose rounding only starts after step 1 (LoRA: the engines get merged weights,
the trainer keeps the adapter apart, zero at step 1); it sits below the sync breaks seen in fp32. A break starts at
the size of what the engines kept behind (one update) and grows with every update after, so one smaller than the
threshold at its first step is stopped once it has grown past it; in bf16, whose healthy gap is large, that takes
more movement, and a break smaller than bf16's own rounding is not seen at all. CEILING sits above the healthy gaps
seen per dtype and below the start-up differences seen on a real model (a misread RoPE base, a layer's weights not
the trainer's); a smaller start-up difference is calibrated on, and the step-1 line shows it. The figures:
benchmarks/results/2026-12-02-sync-guard-calibration.md.
--max_engine_logprob_gap set: that is the threshold, with no ceiling (0 or negative: off); h is still measured and
said. One first step follows a sync after all: that of an engine replaced during it (--max_engine_restarts); the
ceiling still bounds what it can hide.

Two checks need no threshold, and so hold in any dtype at any learning rate, where an update can be smaller than
bf16's own rounding and the gap cannot show it:
- the version check: without --async_train every step samples from the weights of the update just before it; an
  engine tags its samples with the version of the last sync it loaded (rollout/weight_sync.py finish), so samples
  of an older version mean a sync did not reach an engine: the run stops at that step;
- the coverage check (rollout/weight_sync.py, SyncLeftOutError): after a sync of the whole model each engine says
  which of its weights the sync gave no tensor for (vLLM's reload finds them); any, and the run stops naming them
  (a layer left out, a renamed tensor the engine does not know).
A third, in the sync itself: the stale-pack check (rollout/reload_fixes.py stale_packs, SyncStalePackError): after
every sync each engine says which modules still compute with a pre-packed copy of old weights (a tied head whose
shared embedding changed); any, and the run stops at that sync.

The comparison is meaningful only where both sides score the same policy the same way, so it is skipped when
- rollouts are stale (async mode: they came from older weights than the actor holds now; the actor cannot score
  them under the weights that generated them, so only batches generated with the current weights are checked; with
  --partial_rollout a sample's staleness is its oldest token's, so a batch that crossed a sync is never checked), or
- --temperature is not 1 and --top_p is below 1: the engines then report log-probs of the top-p-truncated
  distribution (vLLM's processed_logprobs, rollout/engine.py engine_logprobs_mode), the actor of the full one.
  At --temperature 1 the engines report raw log-probs and at --top_p 1 processed ones: both the actor's.
Either is said once at the start of the run (SyncGuard.announce), not found out later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from orlhf.rollout.engine_config import engine_dtype

log = logging.getLogger(__name__)

MULTIPLE = 4.0  # threshold = MULTIPLE * healthy gap + FLOOR (module docstring)
FLOOR = 1e-4
# The most a healthy engine is taken to differ before any sync, by the engines' dtype (on GPUs bf16 whatever the
# trainer's: rollout/engine_config.py engine_dtype). fp32: the former fixed threshold, above every fp32 gap seen.
CEILING = {"fp32": 1e-3, "bf16": 0.2}


class EngineMismatchError(RuntimeError):
    """The engines' log-probs left the trainer's: the run stops before training on those samples."""


def calibrated(healthy: float) -> float:
    """The threshold for a run whose healthy gap (first step, before any sync) is `healthy`."""
    return MULTIPLE * healthy + FLOOR


def kernels(bf16: bool, device: str) -> str:
    """What the healthy gap depends on besides the model, in words: "fp32 on cpu", "fp32 trainer, bf16 engines on
    cuda". A calibration holds for the kernels it was measured on only."""
    trainer, engines = ("bf16" if bf16 else "fp32"), _dtype(bf16, device)
    return f"{trainer} on {device}" if trainer == engines else f"{trainer} trainer, {engines} engines on {device}"


def _dtype(bf16: bool, device: str) -> str:
    return "bf16" if engine_dtype(bf16, device) == "bfloat16" else "fp32"


@dataclass
class SyncGuard:
    """threshold: --max_engine_logprob_gap when set (0 or negative: off), else calibrated at the first check."""

    flag: Optional[float] = None
    bf16: bool = False
    device: str = "cpu"
    temperature: float = 1.0
    top_p: float = 1.0
    async_train: bool = False
    healthy: Optional[float] = None  # the first checked step's gap (weight version 0)
    threshold_calibrated: Optional[float] = None  # from `healthy`, a checkpoint, or the ceiling
    settled: bool = False  # calibrated, restored from a checkpoint or given the ceiling: nothing left to calibrate

    @classmethod
    def from_config(cls, cfg) -> SyncGuard:
        p = cfg.ppo
        # runtime.device, not cfg.device: a run's config is finished (resolved) by now; the controller's unit tests
        # drive unfinished ones, whose "auto" gets the CPU's
        device = "cuda" if cfg.runtime.device == "cuda" else "cpu"
        flag = cfg.vllm.max_engine_logprob_gap
        return cls(flag, cfg.deepspeed.bf16, device, p.temperature, p.top_p, p.async_train)

    @property
    def on(self) -> bool:
        return self.flag is None or self.flag > 0

    @property
    def threshold(self) -> Optional[float]:
        """The gap past which the run stops: the flag's, or the calibrated one (None before the first check)."""
        return self.flag if self.flag is not None else self.threshold_calibrated

    @property
    def ceiling(self) -> float:
        return CEILING[_dtype(self.bf16, self.device)]

    @property
    def kernels_now(self) -> str:
        return kernels(self.bf16, self.device)

    @property
    def comparable(self) -> bool:
        """Whether the engines' log-probs of sampled tokens are the distribution the actor scores (docstring)."""
        return self.temperature == 1.0 or self.top_p >= 1.0

    def announce(self) -> None:
        """Say once, at the start of the run, where the guard does not look (module docstring)."""
        if not self.on:
            return
        if not self.comparable:
            log.warning(
                "--max_engine_logprob_gap is not checked in this run: at --temperature %g with --top_p %g "
                "the engines report log-probs of the top-p-truncated distribution, the actor of the full "
                "one (engine_logprob_gap is logged, not judged). --top_p 1 or --temperature 1 turns the "
                "check on.",
                self.temperature,
                self.top_p,
            )
        elif self.async_train:
            log.info(
                "--max_engine_logprob_gap with --async_train: checked only on batches generated with the "
                "actor's current weights (staleness 0, e.g. the first step); a stale batch differs by the "
                "policy's own updates, not by the sync"
            )

    def check(self, gap: float, step: int, staleness: int, version: int = 0) -> bool:
        """Raise EngineMismatchError if `gap` (mean |engine - actor| log-prob per token) is past the threshold; the
        first check calibrates it (module docstring).

        step: the 1-based step whose rollouts were scored; staleness: trainer version - generation version;
        version: the weight version that generated them (0: the model folder's, never synced). Returns whether the
        gap was checked. Without --async_train a staleness other than 0 stops the run whatever the gap: an engine
        missed a sync (the version check, module docstring).
        """
        if not self.on:
            return False
        if staleness != 0 and not self.async_train:
            raise EngineMismatchError(self.explain_behind(step, staleness, version))
        if staleness != 0 or not self.comparable:
            return False
        if not self.settled:
            self.calibrate(gap, step, version)
        if not gap <= self.threshold:  # not `gap > threshold`: NaN compares false both ways and must not pass
            raise EngineMismatchError(self.explain(gap, step))
        return True

    def calibrate(self, gap: float, step: int, version: int) -> None:
        """The first check: `gap` is the healthy gap if no sync came before it (version 0). With the flag set the
        calibration is said, not used (a resume without the flag uses it)."""
        self.settled = True
        if version != 0:  # the engines were loaded by a sync: a broken one would be calibrated on
            self.use_ceiling(f"the first checked step, {step}, sampled with synced weights (version {version})")
            return
        if self.flag is None and not gap <= self.ceiling:
            raise EngineMismatchError(self.explain_start(gap, step))
        self.healthy, self.threshold_calibrated = gap, calibrated(gap)
        log.info(
            "sync guard: healthy engine gap %.2g per token at step %d (this model, %s); stopping past %.2g%s",
            gap,
            step,
            self.kernels_now,
            self.threshold,
            f" (--max_engine_logprob_gap; calibrated: {self.threshold_calibrated:.2g})"
            if self.flag is not None
            else "",
        )

    def use_ceiling(self, why: str) -> None:
        self.threshold_calibrated = self.ceiling
        if self.flag is None:
            log.info(
                "sync guard: no healthy engine gap of this run to calibrate on (%s); stopping past %g, the most a "
                "healthy engine is taken to differ (%s)",
                why,
                self.ceiling,
                self.kernels_now,
            )

    # ---- checkpoint (trainer/run_state.py) ----
    def state_dict(self) -> Optional[dict]:
        if self.threshold_calibrated is None:
            return None
        return {"healthy": self.healthy, "threshold": self.threshold_calibrated, "kernels": self.kernels_now}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A resume: keep the checkpoint's calibration when it was made on these kernels, else the ceiling."""
        self.settled = True
        if not self.on or not self.comparable:
            return
        if state is None:
            self.use_ceiling("the checkpoint holds none: saved before the first checked step, or by an older orlhf")
        elif state["kernels"] != self.kernels_now:
            self.use_ceiling(f"the checkpoint's calibration was made with {state['kernels']}")
        else:
            self.healthy, self.threshold_calibrated = state["healthy"], state["threshold"]
            if self.flag is None:
                log.info(
                    "sync guard: stopping past %.2g per token, as calibrated at the start of this run (healthy "
                    "engine gap %s, %s)",
                    self.threshold_calibrated,
                    "unknown" if self.healthy is None else f"{self.healthy:.2g}",
                    self.kernels_now,
                )

    # ---- what the user reads ----
    def explain(self, gap: float, step: int) -> str:
        if self.flag is not None:
            limit = f"--max_engine_logprob_gap {self.flag:g} ({self.kernels_now})"
        elif self.healthy is not None:
            limit = (
                f"the sync guard's threshold {self.threshold:.2g}, calibrated on this run's healthy gap "
                f"{self.healthy:.2g} at its first step ({self.kernels_now})"
            )
        else:
            limit = f"the sync guard's threshold {self.threshold:g}, the healthy ceiling ({self.kernels_now})"
        return (
            f"step {step}: the vLLM engines' log-probs of the sampled tokens differ from the actor's by {gap:.3g} per "
            f"token on average (engine_logprob_gap), past {limit}. The engines are sampling from another policy "
            "than the one being trained, so the run stops here instead of training on those samples. Likely causes: "
            "the weight sync missed weights (a tied lm_head, parameter names the engine does not know, or "
            "pre-packed weights vLLM did not refresh after the reload; see the engine log for 'Failed to load "
            "weights'), or an engine did not receive the last update. If the gap is expected, set "
            "--max_engine_logprob_gap to a threshold above it, or to 0 to turn the check off."
        )

    def explain_behind(self, step: int, staleness: int, version: int) -> str:
        return (
            f"step {step}: its samples came from weight version {version}, {staleness} update(s) behind the actor's "
            f"({version + staleness}). Without --async_train every step samples from the weights of the update "
            "just before it, and an engine takes a version only once it has loaded that sync: a weight sync did not "
            "reach an engine, which is sampling from an older policy. The run stops here instead of training on "
            "those samples; the engine logs (vllm-<i>.log) and driver.log say what the last sync did. "
            "--max_engine_logprob_gap 0 turns the sync guard off, this check included."
        )

    def explain_start(self, gap: float, step: int) -> str:
        return (
            f"step {step}: the vLLM engines' log-probs of the sampled tokens differ from the actor's by {gap:.3g} per "
            "token on average (engine_logprob_gap) before any weight sync, when both hold the weights of the model "
            f"folder; past {self.ceiling:g}, the most a healthy engine is taken to differ ({self.kernels_now}), they "
            "disagree from the first step, so the run stops here instead of training on another model's samples "
            "(and calibrating the sync guard on that difference). Likely causes: vLLM reads this model's folder "
            "otherwise than transformers (a weight it does not load, a config field it ignores or reads "
            "differently; see the engine log). If this gap is expected for this model, set "
            "--max_engine_logprob_gap to a threshold above it (0 turns the check off)."
        )
