"""The rollout backends, one record each: the single place that says what a backend is to the rest of the run.

Everything else reads this table: --rollout_backend's choices (config/backend_config.py), which backend a config
runs (TrainConfig.rollout: --vllm_num_engines 0 resolves to the trainer backend here, once), whether engines are
placed and under which name (distributed/layout.py), where generation memory is counted (launch/plan*.py), the
rules of config/validation_rollout.py, and the class that starts (rollout/backend.py backend_class, imported from
its dotted path only then, so a run loads only its own backend's dependencies). Adding a backend is one row here
plus its class (rollout/backend.py states the contract). No torch here: `orlhf --help` must stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Where a backend's generation memory lives (launch/plan_memory.py counts it there):
ON_ENGINES = "engines"  # engines of its own, placed beside the models (or on the actor's devices, colocated)
ON_ACTOR = "actor"  # the actor's ranks generate: their generation memory comes on top of their training states
OUTSIDE = "outside"  # nothing of this cluster generates (a remote server): no memory to count here
MEMORY_PLACES = (ON_ENGINES, ON_ACTOR, OUTSIDE)


@dataclass(frozen=True)
class BackendSpec:
    cls: str  # "package.module:Class", a RolloutBackend imported only when a run starts it
    engine: Optional[str]  # the layout's name for its engines (pools "<engine>0", occupant "<engine>"); None: none
    memory: str  # where its generation memory lives: one of MEMORY_PLACES
    records_routing: bool = False  # returns the experts it routed each token to (--router_replay R3)
    takes_images: bool = False  # generates from image prompts (vision-language models)
    how: str = ""  # the flags that choose it, as errors name them

    @property
    def places_engines(self) -> bool:
        """It starts engines of its own: --vllm_num_engines counts them and the engine flags configure them."""
        return self.engine is not None

    @property
    def in_actor(self) -> bool:
        """The actor's ranks generate: generation cannot overlap their training, and nothing is synced."""
        return self.memory == ON_ACTOR


BACKENDS: dict[str, BackendSpec] = {
    "vllm": BackendSpec(
        cls="orlhf.rollout.vllm_rollout:VllmRollout",
        engine="vllm",
        memory=ON_ENGINES,
        records_routing=True,
        takes_images=True,
        how="--rollout_backend vllm",
    ),
    "trainer": BackendSpec(
        cls="orlhf.rollout.actor_rollout:ActorRollout", engine=None, memory=ON_ACTOR, how="--rollout_backend trainer"
    ),
}
DEFAULT_BACKEND = "vllm"
NO_ENGINES = "trainer"  # what --vllm_num_engines 0 means for a backend that places engines


def backend_name(rollout_backend: str, num_engines: int) -> str:
    """The backend a run uses: --rollout_backend, except that --vllm_num_engines 0 with one that places engines means
    the actor's ranks generate (OpenRLHF's reading of 0 engines). The one place that rule is written."""
    spec = BACKENDS.get(rollout_backend)
    if spec is not None and spec.places_engines and num_engines == 0:
        return NO_ENGINES
    return rollout_backend


def backend(name: str) -> BackendSpec:
    """The record of `name`; ValueError naming the known ones otherwise."""
    spec = BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown rollout backend {name!r}; expected one of {tuple(BACKENDS)}")
    return spec


def names(**where: bool) -> tuple[str, ...]:
    """Backends whose record matches every given attribute, e.g. names(places_engines=True), in table order."""
    return tuple(k for k, s in BACKENDS.items() if all(getattr(s, a) == v for a, v in where.items()))
