"""--rollout_backend vllm (the default): vLLM engines generate, as Ray actors of their own (rollout/engine_group.py),
and the actor's weights reach them by a weight sync (rollout/weight_sync.py). A RolloutBackend with EngineProcesses
(rollout/backend.py).

VllmBringup, the start-up's steps, decided once from the config:
    own devices              engines and trainers start together (the engines load while DeepSpeed initialises);
                             the engines are awaited once the trainers are up
    colocated on GPUs        the engines first, alone on the GPUs, so vLLM's memory profile sees only itself; then,
                             with --vllm_enable_sleep, they sleep (weights and KV cache freed) before the trainers
                             allocate: OpenRLHF's order. The controller's SleepSwitch starts from that asleep state.
    launch                   the engines' actors on their bundles, not waited for (vLLM's import and LLM() are the
                             longest chain)
    connect                  the engines awaited (unless they were first), then the weight-sync group built with the
                             actor's ranks
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable, Optional

from orlhf.rollout.backend import Bringup, EngineProcesses, RolloutBackend
from orlhf.rollout.engine import EngineActor
from orlhf.rollout.engine_group import EngineGroup
from orlhf.rollout.weight_sync import WeightUpdate, make_weight_sync
from orlhf.types import GenerationRequest, Rollout, SamplingSpec

log = logging.getLogger("orlhf")


class VllmBringup(Bringup):
    def __init__(self, backend: type[VllmRollout], cfg):
        super().__init__(backend, cfg)
        self.engines_first = cfg.engines_colocated and cfg.device == "cuda"
        self.sleep_first = self.engines_first and cfg.vllm.enable_sleep
        if self.engines_first:
            self.steps = (
                ("start_engines", "wait_engines") + (("sleep_engines",) if self.sleep_first else ()) + ("start_models",)
            )
        else:
            self.steps = ("start_engines", "start_models", "wait_engines")

    def launch(self, placed, stack, tuning) -> VllmRollout:
        from orlhf.rollout.engine_config import engine_config

        cfg = self.cfg
        engines = EngineGroup(
            engine_config(cfg),
            [placed.engine_bundles(i) for i in range(cfg.num_engines)],
            timeout_s=cfg.runtime.ray_timeout_s,
            wait=False,
            tuning=tuning,
            hang_s=cfg.runtime.hang_timeout_s,
        )
        stack.callback(engines.shutdown)
        return self.backend(engines)

    def before_models(self, launched: VllmRollout) -> None:
        if self.engines_first:
            pids = launched.engines.wait_ready()
            log.info("vllm engines: %d, pids %s (started before the trainers share their GPUs)", len(launched), pids)
        if self.sleep_first:
            launched.sleep()

    def connect(self, launched: VllmRollout, actor, tokenizer, stack, mark) -> VllmRollout:
        if not self.engines_first:
            log.info("vllm engines: %d, pids %s", len(launched.engines), launched.engines.wait_ready())
        mark("engines ready")
        launched.sync = make_weight_sync(self.cfg, actor, launched.engines)
        mark("weight sync group")
        return launched


class VllmRollout(RolloutBackend, EngineProcesses):
    kind = "vllm"
    turn_params = None  # vLLM's SamplingParams, imported where agents run

    def __init__(self, engines: EngineGroup, sync: Optional[WeightUpdate] = None):
        """`sync`: set by connect once the actor's ranks are up (a launched backend cannot load weights before)."""
        self.engines, self.sync = engines, sync
        self.timeout_s = engines.timeout_s

    @classmethod
    def bringup(cls, cfg) -> VllmBringup:
        return VllmBringup(cls, cfg)

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
