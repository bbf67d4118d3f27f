"""Whoever generates a run's rollouts, declared once: what the controller, the executors, the evaluator and hybrid
mode's memory hand-over need of it (RolloutBackend), what only backends with engine processes of their own add
(EngineProcesses: a member lost and replaced), how a run brings one up (Bringup, a factory of ordered steps), and
the one place a run's backend class is found (backend_class, from its record in config/rollout_backends.py).

    backend                      generates with                         the trainer's weights reach it by
    VllmRollout   (vllm)         vLLM engines, Ray actors of their own  a weight sync (rollout/weight_sync.py)
    ActorRollout  (trainer)      the actor's own ranks (transformers)   nothing to move: they are the trainer's

The contract, as narrow as verl's BaseRollout (generate, update_weights, release/resume) plus what agents and
segments ask (tests/vllm/test_engines.py checks it on both, on real engines and a real ZeRO-3 actor):

    b.generate(prompts, sampling)           sampling.n rollouts per prompt, prompt-major, each tagged with the weight
                                            version that sampled it; the same seeds give the same samples
    b.load_weights(version) -> seconds      the trainer's current weights into every member, after an optimizer
                                            step and before the next generation; rollouts from then on say `version`
    b.sleep() / b.wake_up(tags)             hybrid mode (--vllm_enable_sleep, GPUs): free memory while trainers train
    b.shutdown()
  with defaults a backend may keep:
    len(b)                                  members (engines; 1: the actor's ranks together, or a single server)
    b.generate_turns(member, requests)      agents' turns, token in, token out -> a concurrent Future of
                                            [TurnResult] (types.py); by default one generate call per turn
    b.generate_requests({member: reqs}, s)  requests with their own lengths and seeds (--partial_rollout's segments);
                                            by default refused (validation keeps it to backends that overlap)
    b.turn_params                           the class of agents' sampling parameters (None: vLLM's SamplingParams)
    b.generating_groups                     the trainer's model groups that generate (their states stay on the
                                            device; on CPU the generate phase's cores are theirs)

EngineProcesses (a mix-in of backends whose members are processes of their own, lost apart from the trainer's;
trainer/engine_restart.py drives it): on_lost (a hook for a member lost in a generation), dead() (a health check),
why_not_replaceable(), kill(i), replace(i) (a member started again), reconnect() (the weight path rebuilt for it),
lost_in_sync() (after a failed load_weights, the members lost in it), timeout_s.

Bring-up (launch/bringup.py calls the steps in this order; the backend's Bringup decides once, from the config, what
each step does, so nothing compares step names):

    launch(placed, stack, tuning)   what starts before the model groups (vLLM engines load while DeepSpeed
                                    initialises), shut down when `stack` closes; None when nothing does
    before_models(launched)         what must happen before the trainers allocate (engines first and asleep on
                                    shared GPUs)
    connect(launched, actor, tokenizer, stack, mark)
                                    once the model groups are up: the backend ready to generate and load weights
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Optional

from orlhf.types import GenerationRequest, Rollout, SamplingSpec, TurnParams, TurnResult

if TYPE_CHECKING:
    from contextlib import ExitStack

    from orlhf.config.train_config import TrainConfig
    from orlhf.distributed.tuning import Tuning


class RolloutBackend(ABC):
    """What the controller needs from whoever generates (module docstring)."""

    kind: str = ""  # its name in config/rollout_backends.py
    turn_params: Optional[type] = TurnParams  # agents' sampling parameters; None: vLLM's SamplingParams

    @classmethod
    def bringup(cls, cfg: TrainConfig) -> Bringup:
        """How a run brings it up (module docstring); by default nothing starts before the model groups, and
        from_models builds it once they are up."""
        return Bringup(cls, cfg)

    @classmethod
    def from_models(cls, cfg: TrainConfig, actor, tokenizer) -> RolloutBackend:
        """The default bring-up's last step: the backend, once the model groups are up (`actor`: the actor's group)."""
        raise TypeError(
            f"the {cls.kind or cls.__name__} rollout backend is built by its caller, not by a run's start-up"
        )

    # ---- generating ----
    def __len__(self) -> int:
        return 1

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, images: Optional[list[tuple]] = None
    ) -> list[Rollout]: ...

    def generate_requests(
        self, per_member: dict[int, list[GenerationRequest]], sampling: SamplingSpec
    ) -> list[Rollout]:
        raise TypeError(f"the {self.kind} rollout backend does not generate in segments (--partial_rollout)")

    def generate_turns(self, index: int, requests: list) -> Future:
        """Agents' turns, each one generate call of one sample with the turn's own seed (what a SamplingSpec cannot
        carry is refused by name); a backend that batches turns overrides this."""
        done: Future = Future()
        try:
            done.set_result([self._turn(ids, params) for ids, params in requests])
        except Exception as e:  # noqa: BLE001 - the agent runner raises it where it waits
            done.set_exception(e)
        return done

    def _turn(self, ids: list[int], params) -> TurnResult:
        for name, off in (("stop", (None, [])), ("stop_token_ids", (None, [])), ("top_k", (0, -1)), ("min_p", (0.0,))):
            if getattr(params, name, off[0]) not in off:
                raise ValueError(
                    f"sampling_params.{name} = {getattr(params, name)!r}: the {self.kind} rollout "
                    "backend samples with temperature, top_p, max_tokens and a seed only"
                )
        spec = SamplingSpec(params.temperature, params.top_p, params.max_tokens, n=1, seed=params.seed or 0)
        (r,) = self.generate([list(ids)], spec)
        return TurnResult(r.response_ids, r.logprobs, "stop" if r.finished else "length", r.weight_version)

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

    def shutdown(self) -> None:
        return None


class EngineProcesses(ABC):
    """A RolloutBackend mix-in: its members are processes of their own, lost apart from the trainer's and replaced
    one by one (trainer/engine_restart.py; module docstring)."""

    timeout_s: float = 600.0  # --ray_timeout_s: how long one call to a member may take
    on_lost: Optional[Callable[[dict, str], None]] = None

    @abstractmethod
    def dead(self, timeout_s: float = 10.0) -> dict[int, Exception]:
        """{member: its error} of the members whose process is gone."""

    @abstractmethod
    def why_not_replaceable(self) -> Optional[str]:
        """None when a lost member can be replaced, else why not."""

    @abstractmethod
    def kill(self, index: int) -> None: ...

    @abstractmethod
    def replace(self, index: int) -> int:
        """Member `index` started again on its own bundles; returns its pid."""

    @abstractmethod
    def reconnect(self) -> None:
        """The weight path rebuilt for every member (a group cannot take a new member)."""

    @abstractmethod
    def lost_in_sync(self) -> dict[int, Exception]:
        """After a failed load_weights: {member: its error} of the members lost in it (empty: none was)."""


class Bringup:
    """A backend's start-up as a factory of ordered steps (module docstring). This default starts nothing before the
    model groups and builds the backend with from_models after them."""

    steps: tuple[str, ...] = ("start_models",)  # the order, as `orlhf` logs and tests read it

    def __init__(self, backend: type[RolloutBackend], cfg: TrainConfig):
        self.backend, self.cfg = backend, cfg

    def launch(self, placed, stack: ExitStack, tuning: Tuning) -> Optional[RolloutBackend]:
        return None

    def before_models(self, launched: Optional[RolloutBackend]) -> None:
        return None

    def connect(
        self, launched: Optional[RolloutBackend], actor, tokenizer, stack: ExitStack, mark: Callable[[str], None]
    ) -> RolloutBackend:
        rollout = self.backend.from_models(self.cfg, actor, tokenizer)
        stack.callback(rollout.shutdown)
        return rollout


def backend_class(cfg: TrainConfig) -> type[RolloutBackend]:
    """The run's rollout backend: the class its record names (config/rollout_backends.py: --rollout_backend, with
    --vllm_num_engines 0 resolved to the trainer backend there). Imported here, so a run loads only its own backend's
    dependencies."""
    module, _, name = cfg.rollout.cls.partition(":")
    return getattr(importlib.import_module(module), name)
