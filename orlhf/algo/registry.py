"""The advantage estimators, one record each: the single place that says what an estimator needs.

Everything else reads this table: the --advantage_estimator choices (config/train_config.py), whether a critic exists
(TrainConfig.has_critic), the group rules of config/validation.py, the group baseline (algo/rewards.py), whitening
(algo/advantages.py), the roles placed (config/roles.py). Adding an estimator is one row here plus its math.
No torch here: config/train_config.py imports it, and `orlhf --help` must stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EstimatorSpec:
    needs_critic: bool  # advantages come from a value model (GAE): the run has a critic
    # Baseline subtracted from the scores (rewards.group_baseline):
    #   None: no baseline; "leave_one_out": mean of the other n-1; "mean": group mean; "mean_std": (r - mean) / std;
    #   "batch_mean": mean of the whole rollout batch, no groups.
    # A group baseline compares samples of one prompt (n_samples_per_prompt >= 2); any baseline is on the final
    # score, so it needs gamma 1.
    baseline: Optional[str]
    whiten: bool  # advantages whitened over the batch's real tokens (OpenRLHF's choice per estimator)
    std_free: Optional[str] = None  # the estimator to suggest for this one without its / std (--no_advantage_std_norm)

    @property
    def needs_groups(self) -> bool:
        """The baseline compares several samples of one prompt: n_samples_per_prompt >= 2."""
        return self.baseline is not None and self.baseline != "batch_mean"

    @property
    def whole_response(self) -> bool:
        """A baseline on the final score: the rewards must not be discounted (gamma 1)."""
        return self.baseline is not None


# Whitening follows OpenRLHF's experience maker (checked in its current source): gae, reinforce and
# reinforce_baseline are whitened; rloo, group_norm and dr_grpo are not (their group baseline already centres
# them, and group_norm already scales them; dr_grpo deliberately keeps the raw scale). flash_reinforce (0.11.2's
# FlashREINFORCE, for one sample per prompt) centres on the rollout batch's mean and is not whitened either.
ESTIMATORS: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(needs_critic=True, baseline=None, whiten=True),
    "reinforce": EstimatorSpec(needs_critic=False, baseline=None, whiten=True),
    "rloo": EstimatorSpec(needs_critic=False, baseline="leave_one_out", whiten=False),
    "reinforce_baseline": EstimatorSpec(needs_critic=False, baseline="mean", whiten=True),
    "group_norm": EstimatorSpec(needs_critic=False, baseline="mean_std", whiten=False, std_free="dr_grpo"),
    "dr_grpo": EstimatorSpec(needs_critic=False, baseline="mean", whiten=False),
    "flash_reinforce": EstimatorSpec(needs_critic=False, baseline="batch_mean", whiten=False),
}


def estimator(name: str) -> EstimatorSpec:
    """The record of `name`; ValueError naming the known ones otherwise."""
    spec = ESTIMATORS.get(name)
    if spec is None:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {tuple(ESTIMATORS)}")
    return spec


def names(**where: bool) -> tuple[str, ...]:
    """Estimators whose record matches every given attribute, e.g. names(needs_groups=True), in table order."""
    return tuple(k for k, s in ESTIMATORS.items() if all(getattr(s, a) == v for a, v in where.items()))
