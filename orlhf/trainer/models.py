"""What the controller drives: the model groups and the rollout backend of a run (launch/bringup.py builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from orlhf.distributed.tuning import Tuning

if TYPE_CHECKING:  # annotations only: the loop itself imports no Ray (benchmarks/hybrid_engine_baseline.py runs it
    # on SPMD ranks without Ray, with groups of its own that answer the same calls)
    from orlhf.distributed.groups import ActorGroup
    from orlhf.rollout.backend import RolloutBackend


@dataclass
class Models:
    """Everything the controller drives. critic exists with gae only; reward with --reward_pretrain only; ref only
    when a KL uses it (TrainConfig.has_reference). rollout: whoever generates (rollout/backend.py: vLLM engines and
    their weight sync, or the actor's ranks). tuning: the platform's hooks the groups were built with."""

    actor: ActorGroup
    ref: Optional[ActorGroup]
    rollout: RolloutBackend
    critic: Optional[ActorGroup] = None
    reward: Optional[ActorGroup] = None
    tuning: Tuning = field(default_factory=Tuning)

    def groups(self) -> list:
        return [g for g in (self.actor, self.ref, self.critic, self.reward) if g is not None]

    def trained(self) -> list[tuple[str, ActorGroup]]:
        """(role, group) of the models that learn, whose DeepSpeed state a checkpoint holds."""
        return [("actor", self.actor)] + ([("critic", self.critic)] if self.critic else [])
