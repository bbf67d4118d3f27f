"""Whoever generates a run's rollouts, declared once: what the controller, the executors, the evaluator, hybrid
mode's memory hand-over and engine restarts need of it (RolloutBackend), and the one place a run's backend is chosen
(backend_class).

    backend                      generates with                         the trainer's weights reach it by
    VllmRollout   (vllm)         vLLM engines, Ray actors of their own  a weight sync (rollout/weight_sync.py)
    ActorRollout  (trainer)      the actor's own ranks (transformers)   nothing to move: they are the trainer's

The contract (tests/vllm/test_engines.py checks it on both, on real engines and a real ZeRO-3 actor):

    len(b)                                  members (engines; the actor's ranks together count as one)
    b.generate(prompts, sampling)           sampling.n rollouts per prompt, prompt-major, each tagged with the weight
                                            version that sampled it; the same seeds give the same samples
    b.generate_requests({member: reqs}, s)  requests with their own lengths and seeds (--partial_rollout's segments)
    b.generate_turns(member, requests)      agents' turns, token in, token out -> a concurrent Future of
                                            [(new ids, log-probs, finish reason, weight version, ...)] (vLLM
                                            engines add the routed experts, --router_replay R3)
    b.turn_params                           the class of agents' sampling parameters (None: vLLM's SamplingParams)
    b.load_weights(version) -> seconds      the trainer's current weights into every member, after an optimizer
                                            step and before the next generation; rollouts from then on say `version`
    b.sleep() / b.wake_up(tags)             hybrid mode (--vllm_enable_sleep, GPUs): free memory while trainers train
    b.generating_groups                     the trainer's model groups that generate (their states stay on the
                                            device; on CPU the generate phase's cores are theirs)
    b.separate_processes                    members are processes of their own, lost apart from the trainer's;
      b.on_lost / b.dead() / b.kill(i)      then: a hook for a member lost in a generation, a health check,
      b.why_not_replaceable()               whether a lost member can be replaced (None) or why not,
      b.replace(i) / b.reconnect()          a member started again, the weight path rebuilt for it,
      b.lost_in_sync()                      after a failed load_weights, the members lost in it
    b.shutdown()

Bringing a backend up is its own (launch/bringup.py drives it in this order): `start_plan(cfg)` names the start-up
steps, `launch(...)` starts what runs before the model groups (vLLM engines load while DeepSpeed initialises; None
when nothing does), and `connect(...)` finishes it once the model groups are up (the weight-sync group, or the
actor group handed over).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Optional

from orlhf.types import GenerationRequest, Rollout, SamplingSpec

if TYPE_CHECKING:
    from contextlib import ExitStack

    from orlhf.config.train_config import TrainConfig
    from orlhf.distributed.tuning import Tuning


class RolloutBackend(ABC):
    """What the controller needs from whoever generates (module docstring)."""

    kind: str = ""  # --rollout_backend's value for it
    turn_params: Optional[type] = None  # agents' sampling parameters; None: vLLM's SamplingParams
    separate_processes: bool = False  # members are processes of their own (see the module docstring)
    timeout_s: float = 600.0  # --ray_timeout_s: how long one call to a member may take

    # ---- bringing it up (launch/bringup.py) ----
    @classmethod
    @abstractmethod
    def start_plan(cls, cfg: TrainConfig) -> tuple[str, ...]:
        """The start-up steps in order; "start_models" is the model groups'."""

    @classmethod
    def launch(cls, cfg: TrainConfig, placed, stack: ExitStack, tuning: Tuning) -> Optional[RolloutBackend]:
        """Start what runs before the model groups, shut down when `stack` closes; None: nothing does."""
        return None

    def before_models(self, plan: tuple[str, ...]) -> None:
        """The plan's steps that come before the model groups (e.g. engines ready and asleep on shared GPUs)."""
        return None

    @classmethod
    @abstractmethod
    def connect(
        cls,
        cfg: TrainConfig,
        launched: Optional[RolloutBackend],
        actor,
        tokenizer,
        stack: ExitStack,
        mark: Callable[[str], None],
    ) -> RolloutBackend:
        """Once the model groups are up (`actor`: the actor's group): the backend ready to generate and to load
        weights, shut down when `stack` closes. `mark`: the start-up clock's, after each phase."""

    # ---- generating ----
    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, images: Optional[list[tuple]] = None
    ) -> list[Rollout]: ...

    def generate_requests(
        self, per_member: dict[int, list[GenerationRequest]], sampling: SamplingSpec
    ) -> list[Rollout]:
        raise NotImplementedError(f"the {self.kind} rollout backend does not generate in segments (--partial_rollout)")

    @abstractmethod
    def generate_turns(self, index: int, requests: list) -> Future: ...

    # ---- weights and memory ----
    @abstractmethod
    def load_weights(self, version: int) -> float:
        """The trainer's current weights into every member; returns the seconds it took."""

    def sleep(self) -> None:
        """Free the members' device memory while the trainers train (nothing to free by default)."""
        return None

    def wake_up(self, tags: list[str]) -> None:
        """Take back what sleep freed: ["weights"] before a weight load, ["kv_cache"] before generating."""
        return None

    @property
    def generating_groups(self) -> tuple:
        return ()

    # ---- members lost and replaced (separate_processes) ----
    on_lost: Optional[Callable[[dict, str], None]] = None

    def dead(self, timeout_s: float = 10.0) -> dict[int, Exception]:
        """{member: its error} of the members whose process is gone (none of its own: none)."""
        return {}

    def why_not_replaceable(self) -> Optional[str]:
        return f"the {self.kind} rollout backend has no members of its own to replace"

    def kill(self, index: int) -> None:
        raise NotImplementedError(self.why_not_replaceable())

    def replace(self, index: int) -> int:
        raise NotImplementedError(self.why_not_replaceable())

    def reconnect(self) -> None:
        raise NotImplementedError(self.why_not_replaceable())

    def lost_in_sync(self) -> dict[int, Exception]:
        """After a failed load_weights: {member: its error} of the members lost in it (empty: none was)."""
        return {}

    @abstractmethod
    def shutdown(self) -> None: ...


def backend_class(cfg: TrainConfig) -> type[RolloutBackend]:
    """The run's rollout backend: the class its record names (config/rollout_backends.py: --rollout_backend, with
    --vllm_num_engines 0 resolved to the trainer backend there). Imported here, so a run loads only its own backend's
    dependencies."""
    module, _, name = cfg.rollout.cls.partition(":")
    return getattr(importlib.import_module(module), name)
