"""--rollout_backend vllm (the default): vLLM engines generate, as Ray actors of their own (rollout/engine_group.py),
and the actor's weights reach them by a weight sync (rollout/weight_sync.py). A RolloutBackend (rollout/backend.py).

    start_plan   own devices: engines and trainers start together (the engines load while DeepSpeed initialises);
                 colocated on GPUs: the engines first, alone on the GPUs, so vLLM's memory profile sees only itself;
                 then, with --vllm_enable_sleep, they sleep (weights and KV cache freed) before the trainers allocate:
                 OpenRLHF's order. The controller's SleepSwitch starts from that asleep state.
    launch       the engines' actors on their bundles, not waited for (vLLM's import and LLM() are the longest chain)
    connect      the engines awaited, then the weight-sync group built with the actor's ranks
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable, Optional

from orlhf.rollout.backend import RolloutBackend
from orlhf.rollout.engine import EngineActor
from orlhf.rollout.engine_group import EngineGroup
from orlhf.rollout.weight_sync import WeightUpdate, make_weight_sync
from orlhf.types import GenerationRequest, Rollout, SamplingSpec

log = logging.getLogger("orlhf")


class VllmRollout(RolloutBackend):
    kind = "vllm"
    separate_processes = True

    def __init__(self, engines: EngineGroup, sync: Optional[WeightUpdate] = None):
        """`sync`: set by connect once the actor's ranks are up (a launched backend cannot load weights before)."""
        self.engines, self.sync = engines, sync
        self.timeout_s = engines.timeout_s
        self._plan: tuple[str, ...] = ()

    # ---- bringing it up ----
    @classmethod
    def start_plan(cls, cfg) -> tuple[str, ...]:
        if cfg.engines_colocated and cfg.device == "cuda":
            sleep = ("sleep_engines",) if cfg.vllm.enable_sleep else ()
            return ("start_engines", "wait_engines") + sleep + ("start_models",)
        return ("start_engines", "start_models", "wait_engines")

    @classmethod
    def launch(cls, cfg, placed, stack, tuning) -> VllmRollout:
        from orlhf.rollout.engine_config import engine_config

        engines = EngineGroup(
            engine_config(cfg),
            [placed.engine_bundles(i) for i in range(cfg.num_engines)],
            timeout_s=cfg.runtime.ray_timeout_s,
            wait=False,
            tuning=tuning,
            hang_s=cfg.runtime.hang_timeout_s,
        )
        stack.callback(engines.shutdown)
        return cls(engines)

    def before_models(self, plan: tuple[str, ...]) -> None:
        self._plan = plan
        if plan.index("wait_engines") < plan.index("start_models"):
            log.info(
                "vllm engines: %d, pids %s (started before the trainers share their GPUs)",
                len(self.engines),
                self.engines.wait_ready(),
            )
        if "sleep_engines" in plan:
            self.sleep()

    @classmethod
    def connect(cls, cfg, launched, actor, tokenizer, stack, mark) -> VllmRollout:
        plan = launched._plan or cls.start_plan(cfg)
        if plan.index("wait_engines") > plan.index("start_models"):
            log.info("vllm engines: %d, pids %s", len(launched.engines), launched.engines.wait_ready())
        mark("engines ready")
        launched.sync = make_weight_sync(cfg, actor, launched.engines)
        mark("weight sync group")
        return launched

    # ---- generating ----
    def __len__(self) -> int:
        return len(self.engines)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, images: Optional[list[tuple]] = None
    ) -> list[Rollout]:
        return self.engines.generate(prompts, sampling, images)

    def generate_requests(
        self, per_member: dict[int, list[GenerationRequest]], sampling: SamplingSpec
    ) -> list[Rollout]:
        return self.engines.generate_requests(per_member, sampling)

    def generate_turns(self, index: int, requests: list) -> Future:
        return self.engines.generate_turns(index, requests)

    # ---- weights and memory ----
    def load_weights(self, version: int) -> float:
        return self.sync.sync(version)

    def sleep(self) -> None:
        self.engines.call(EngineActor.sleep).get()

    def wake_up(self, tags: list[str]) -> None:
        self.engines.call(EngineActor.wake_up, tags).get()

    # ---- engines lost and replaced ----
    @property
    def on_lost(self) -> Optional[Callable[[dict, str], None]]:
        return self.engines.on_lost

    @on_lost.setter
    def on_lost(self, hook: Optional[Callable[[dict, str], None]]) -> None:
        self.engines.on_lost = hook  # EngineGroup.generate calls it, then sends the lost engine's chunk again

    def dead(self, timeout_s: float = 10.0) -> dict[int, Exception]:
        return self.engines.dead(timeout_s)

    def why_not_replaceable(self) -> Optional[str]:
        if self.sync is None or self.sync.restartable:
            return None
        name = type(self.sync).__name__
        return f"{name} (CUDA IPC weight sync, --colocate_all_models on GPUs) is not restartable"

    def kill(self, index: int) -> None:
        self.engines.kill(index)

    def replace(self, index: int) -> int:
        return self.engines.replace(index)

    def reconnect(self) -> None:
        self.sync.reconnect()

    def lost_in_sync(self) -> dict[int, Exception]:
        return self.sync.lost_engines()

    def shutdown(self) -> None:
        self.engines.shutdown()
