"""The sync guard: stop a run whose engines sample from another policy than the one being trained.

Every step the controller has, for the same sampled tokens, the engine's log-probs (from generation) and the
actor's (scoring, before training). With the weights in step they agree to rounding (fp32: ~1e-7 mean absolute
difference per token; bf16: ~1e-3); a sync that missed weights (a tied head, a renamed or fused tensor, a
pre-packed copy vLLM did not refresh) gives 1e-2 and more, and PPO would then train on another policy's samples
while the reward curve looks plausible. `--max_engine_logprob_gap` bounds that mean; past it the run stops.

The comparison is meaningful only where both sides score the same policy the same way, so it is skipped when
- rollouts are stale (async mode: they came from older weights than the actor holds now), or
- --temperature is not 1: vLLM reports log-probs of the raw logits, the actor of logits / temperature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

# Defaults by training dtype: a healthy run sits orders of magnitude below, a broken sync above (measured on
# tiny models: fp32 healthy <= 3e-7, broken 7e-3..5e-2; bf16 healthy ~1e-3, and GPU kernels differ more).
DEFAULT_MAX_GAP = {"fp32": 1e-3, "bf16": 5e-2}


class EngineMismatchError(RuntimeError):
    """The engines' log-probs left the trainer's: the run stops before training on those samples."""


def max_gap(flag: Optional[float], bf16: bool) -> Optional[float]:
    """The threshold in force: the flag if set (0 or negative: guard off -> None), else the dtype's default."""
    if flag is None:
        return DEFAULT_MAX_GAP["bf16" if bf16 else "fp32"]
    return flag if flag > 0 else None


@dataclass
class SyncGuard:
    threshold: Optional[float]  # None: off
    bf16: bool = False
    temperature: float = 1.0
    _warned: bool = False

    @classmethod
    def from_config(cls, cfg) -> SyncGuard:
        bf16 = cfg.deepspeed.bf16
        return cls(max_gap(cfg.vllm.max_engine_logprob_gap, bf16), bf16, cfg.ppo.temperature)

    def check(self, gap: float, step: int, staleness: int) -> bool:
        """Raise EngineMismatchError if `gap` (mean |engine - actor| log-prob per token) is past the threshold.

        step: the 1-based step whose rollouts were scored; staleness: trainer version - generation version.
        Returns whether the gap was checked.
        """
        if self.threshold is None or staleness != 0:
            return False
        if self.temperature != 1.0:
            if not self._warned:
                self._warned = True
                log.warning("--max_engine_logprob_gap is not checked at --temperature %g: vLLM reports log-probs "
                            "before temperature, the actor after it", self.temperature)
            return False
        if gap > self.threshold:
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
