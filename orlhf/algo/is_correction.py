"""What an importance-sampling (IS) correction of the engine/trainer log-prob gap is: OpenRLHF 0.11.2's three knobs.

The engines sample with their own numerics, so pi_engine differs from the trainer's pi_old on the same weights. The
correction reads w = pi_old / pi_engine per token (no gradient) and gates one statistic per unit:

    level   token: each token is a unit;  seq: each sequence is (its mean statistic, gating mask only)
    gating  ratio: the statistic is w (at seq level the geometric mean of w);  binary_kl / tv: a divergence between
            the engine's and the trainer's probability of the sampled token (at seq level its mean), an upper bound
            only (a trust region: LOW must be 0)
    mode    mask: a unit outside [LOW, HIGH] gets weight 0, a unit inside keeps its tokens' w;
            clip: each token's weight is w clamped to [LOW, HIGH] (token level, ratio gating only)

OpenRLHF v0.10.1 / v0.11.0's named schemes are three points of that space (NAMED): tis = token clip ratio, icepop =
token mask ratio, seq-mask-tis = seq mask ratio. The tensor math is orlhf/algo/losses.py's; nothing here imports
torch (config/ppo_config.py reads these tables, and `orlhf --help` must stay fast).

Against OpenRLHF 0.11.2 (models/loss.py PolicyLoss; tests/unit/test_loss_options.py compares the numbers): the same
loss and gradient for every combination it accepts, and the same refusals (refused() below; orlhf refuses at
validation, exit 2, where 0.11.2 raises when the actor starts). Where orlhf differs:
  - a token weight reads log w clamped to +-20 before exp (as the policy ratio), so a token whose engine/trainer
    gap exceeds 20 nats weighs exp(20) where 0.11.2 weighs exp(gap) (which overflows past 88);
  - a sequence without real tokens has mean statistic 0, not 0/0; it adds nothing to the loss either way, but
    is_cut_frac (0.11.2's is_filter_ratio) counts only sequences with a real token;
  - the flags: mode or gating given without a level, or with gspo (whose correction is in its sequence ratio), do
    nothing in 0.11.2 and exit 2 in orlhf, as --vllm_is_correction_type does; the thresholds are LOW HIGH with
    0 <= LOW < HIGH (0.11.2 also takes a single HIGH, meaning 0 HIGH).
"""

from __future__ import annotations

from dataclasses import dataclass

IS_LEVELS = ("off", "token", "seq")
IS_MODES = ("mask", "clip")
IS_GATINGS = ("ratio", "binary_kl", "tv")
# --vllm_is_correction_type (v0.10.1 / v0.11.0) -> (level, mode, gating): the same computation in 0.11.2's terms.
NAMED: dict[str, tuple[str, str, str]] = {
    "tis": ("token", "clip", "ratio"),
    "icepop": ("token", "mask", "ratio"),
    "seq-mask-tis": ("seq", "mask", "ratio"),
}
IS_CORRECTION_TYPES = tuple(NAMED)
DEFAULTS = ("off", "mask", "ratio")  # OpenRLHF 0.11.2's: no correction


@dataclass(frozen=True)
class IsCorrection:
    """One IS correction that is on (level token or seq); None stands for off."""

    level: str  # token | seq
    mode: str = "mask"  # mask | clip
    gating: str = "ratio"  # ratio | binary_kl | tv
    threshold: tuple[float, float] = (0.5, 5.0)  # [LOW, HIGH] on the gated statistic

    def __post_init__(self):
        if self.level not in IS_LEVELS[1:] or self.mode not in IS_MODES or self.gating not in IS_GATINGS:
            raise ValueError(f"unknown IS correction {self.level}/{self.mode}/{self.gating}")
        problem = refused(self.level, self.mode, self.gating, self.threshold)
        if problem:
            raise ValueError(problem)

    @classmethod
    def named(cls, name: str, threshold: tuple[float, float] = (0.5, 5.0)) -> "IsCorrection":
        """tis, icepop or seq-mask-tis (NAMED)."""
        if name not in NAMED:
            raise ValueError(f"unknown IS correction {name!r}; expected one of {IS_CORRECTION_TYPES}")
        level, mode, gating = NAMED[name]
        return cls(level, mode, gating, tuple(threshold))

    @property
    def name(self) -> str:
        """The v0.10.1 name where there is one (icepop), else level/mode/gating (seq/mask/binary_kl)."""
        triple = (self.level, self.mode, self.gating)
        return next((n for n, t in NAMED.items() if t == triple), "/".join(triple))


def refused(level: str, mode: str, gating: str, threshold: tuple[float, float]) -> str | None:
    """Why OpenRLHF 0.11.2's PolicyLoss refuses this combination, or None. Only a token's ratio is a weight that can
    be clamped (a sequence's mean or a divergence can only filter), and a divergence is bounded from above only."""
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        return f"mode clip clamps a token's ratio: it needs level token and gating ratio (got {level}, {gating})"
    if gating != "ratio" and level != "off" and float(threshold[0]) > 0:
        return f"gating {gating} takes an upper bound only: LOW must be 0 (got {threshold[0]})"
    return None
