"""The sync guard: stop a run whose engines sample from another policy than the one being trained.

Every step the controller has, for the same sampled tokens, the engine's log-probs (from generation) and the actor's
(scoring, before training). With the weights in step they agree to rounding; a sync that missed weights (a tied head, a
renamed or fused tensor, a pre-packed copy vLLM did not refresh) gives a mean gap per token orders of magnitude larger,
and PPO would then train on another policy's samples while the reward curve looks plausible. `--max_engine_logprob_gap`
bounds that mean; past it the run stops.

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

log = logging.getLogger(__name__)

# Defaults by training dtype: a healthy run sits well below, a broken sync (a tied head, MoE experts, an engine one
# update behind) above; tests/vllm/family_rig.py measures both sides with this statistic on tiny random models (Llama
# untied and tied, Qwen2-MoE, GPT-2). On GPUs the engines run bfloat16 whatever the trainer's dtype (rollout/engine.py:
# vLLM's GPU attention wants 16 bits), and vLLM's kernels and the trainer's differ more than on CPU, so the default is
# looser: it still stops the tied-head and one-update-behind breaks, not the MoE one. A GPU run that measures its
# healthy gap can tighten it with the flag; the error says how to raise it.
DEFAULT_MAX_GAP = {"fp32": 1e-3, "bf16": 3e-3, "cuda": 2e-2}


class EngineMismatchError(RuntimeError):
    """The engines' log-probs left the trainer's: the run stops before training on those samples."""


def max_gap(flag: Optional[float], bf16: bool, device: str = "cpu") -> Optional[float]:
    """The threshold in force: the flag if set (0 or negative: guard off -> None), else the default for the
    device (cuda: engines in bf16 on GPU kernels) or, on CPU, for the training dtype."""
    if flag is None:
        return DEFAULT_MAX_GAP["cuda" if device == "cuda" else "bf16" if bf16 else "fp32"]
    return flag if flag > 0 else None


@dataclass
class SyncGuard:
    threshold: Optional[float]  # None: off
    bf16: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    async_train: bool = False

    @classmethod
    def from_config(cls, cfg) -> SyncGuard:
        p = cfg.ppo
        # runtime.device, not cfg.device: a run's config is finished (resolved) by now; the controller's unit tests
        # drive unfinished ones, whose "auto" gets the CPU defaults
        return cls(
            max_gap(cfg.vllm.max_engine_logprob_gap, cfg.deepspeed.bf16, cfg.runtime.device),
            cfg.deepspeed.bf16,
            p.temperature,
            p.top_p,
            p.async_train,
        )

    @property
    def comparable(self) -> bool:
        """Whether the engines' log-probs of sampled tokens are the distribution the actor scores (docstring)."""
        return self.temperature == 1.0 or self.top_p >= 1.0

    def announce(self) -> None:
        """Say once, at the start of the run, where the guard does not look (module docstring)."""
        if self.threshold is None:
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

    def check(self, gap: float, step: int, staleness: int) -> bool:
        """Raise EngineMismatchError if `gap` (mean |engine - actor| log-prob per token) is past the threshold.

        step: the 1-based step whose rollouts were scored; staleness: trainer version - generation version.
        Returns whether the gap was checked.
        """
        if self.threshold is None or staleness != 0 or not self.comparable:
            return False
        if not gap <= self.threshold:  # not `gap > threshold`: NaN compares false both ways and must not pass
            raise EngineMismatchError(explain(gap, step, self.threshold, self.bf16))
        return True


def explain(gap: float, step: int, threshold: float, bf16: bool) -> str:
    dtype = "bf16" if bf16 else "fp32"
    return (
        f"step {step}: the vLLM engines' log-probs of the sampled tokens differ from the actor's by {gap:.3g} per "
        f"token on average (engine_logprob_gap), past --max_engine_logprob_gap {threshold:g} ({dtype}). The "
        "engines are sampling from another policy than the one being trained, so the run stops here instead of "
        "training on those samples. Likely causes: the weight sync missed weights (a tied lm_head, parameter "
        "names the engine does not know, or pre-packed weights vLLM did not refresh after the reload; see the "
        "engine log for 'Failed to load weights'), or the engines run another dtype than the trainer (--bf16 "
        "sets both). If the gap is expected (e.g. kernels that differ more in bf16), raise "
        "--max_engine_logprob_gap, or set it to 0 to turn the check off."
    )
