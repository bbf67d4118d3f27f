"""The group of vLLM engines (rollout/engine.py's actors): prompts split across them, calls to all or one.

    EngineGroup(cfg, slots)                       N engines, each on its own bundles (TP bundles on one node)
      .generate(prompts, sampling) -> [Rollout]   prompts split contiguously, results back in prompt order; an
                                                  engine lost meanwhile goes to .on_lost, then its chunk again
      .generate_requests({engine: requests}, sampling)  requests with their own lengths and seeds, on the engines
                                                  named (--partial_rollout's continuations, rollout/partial.py)
      .replace(i)                                 engine i killed and started again on its own bundles
      .call(EngineActor.reset_prefix_cache)       every engine -> GroupCall (.get() waits), as ActorGroup.call
      .call(WeightSyncExtension.orlhf_ipc_begin)  an extension method: runs on every vLLM worker of each engine
      .call_rank(i, EngineActor.generate_tokens, requests)   one engine

A lost engine (its process died, or its generate missed the --ray_timeout_s deadline) stops the run with its name,
unless the trainer set `on_lost` (trainer/engine_restart.py): that replaces it and loads the current weights, and
generate sends the lost engine's chunk again, the same requests with the same seeds (types.request_seed), while
the chunks the other engines finished are kept.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orlhf.distributed.endpoints import check_exports, method_name
from orlhf.distributed.groups import GroupCall, RankError, health_check, settle, wait_all
from orlhf.distributed.placement import EngineBundles, wait_placed
from orlhf.distributed.tuning import Tuning
from orlhf.rollout.engine import ROLE, EngineActor, RemoteEngine
from orlhf.rollout.engine_config import EngineConfig
from orlhf.rollout.worker_ext import WeightSyncExtension
from orlhf.storage.logs import LOG_DIR_ENV
from orlhf.types import GenerationRequest, Rollout, SamplingSpec

START_TRIES = 4  # starts of a replacement engine whose process dies while starting (replace)
RESTART_WAIT_S = 5  # x the try: the waits before starting it again (5, 10, 15 s: a lost node is noticed meanwhile)
log = logging.getLogger(__name__)


class EngineGroup:
    """N engines; `generate` splits prompts across them and returns rollouts in prompt order. `tuning`: the
    platform's hooks each engine starts with (distributed/tuning.py; None: the plain path)."""

    def __init__(
        self,
        cfg: EngineConfig,
        slots: Sequence[EngineBundles],
        timeout_s: float = 600.0,
        wait: bool = True,
        tuning: Optional[Tuning] = None,
        hang_s: Optional[float] = None,
    ):
        self.cfg, self.timeout_s, self.tuning, self._slots = cfg, timeout_s, tuning or Tuning(), list(slots)
        self.hang_s = hang_s  # --hang_timeout_s: calls health-check their engines (distributed/heartbeat.py)
        # on_lost(lost, where): {engine index: its RankError or TimeoutError} lost in `where` ("generate"); replaces
        # them (self.replace) and loads the current weights, or raises. None: a lost engine stops the run.
        self.on_lost: Optional[Callable[[dict, str], None]] = None
        check_exports(ROLE, EngineActor, WeightSyncExtension)  # before any engine starts
        self._engines = [self._spawn(i, engine_slots) for i, engine_slots in enumerate(slots)]
        self._started = [e.pid.remote() for e in self._engines]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> list[int]:
        """Block until every engine has loaded its model (start-up can overlap other work until then)."""
        return wait_all(self._started, list(range(len(self._engines))), ROLE, "start", self.timeout_s)

    def _spawn(self, index: int, slot: EngineBundles):
        # TP 1: the engine actor itself holds the device share. TP > 1 (GPU): vLLM's own Ray workers take the
        # bundles, so the engine actor takes no GPU.
        share = slot.share if self.cfg.tensor_parallel_size == 1 else 0
        opts: dict[str, Any] = {
            "num_cpus": share if self.cfg.device == "cpu" else 0,
            "num_gpus": share if self.cfg.device == "cuda" else 0,
            "max_restarts": 0,
        }
        if slot.placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slot.placement_group,
                placement_group_bundle_index=slot.bundle_indices[0],
                placement_group_capture_child_tasks=True,
            )
        return RemoteEngine.options(**opts).remote(
            self.cfg, index, list(slot.bundle_indices), slot.share, os.environ.get(LOG_DIR_ENV), self.tuning
        )

    def __len__(self) -> int:
        return len(self._engines)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, images: Optional[list[tuple]] = None
    ) -> list[Rollout]:
        """All rollouts, ordered by prompt then sample. Prompts are split contiguously over the engines; the chunk
        of an engine lost meanwhile is generated again once on_lost has replaced it (the others' are kept).
        images: each prompt's images as encoded files (vision-language models), () for a text prompt."""
        if images is None:
            indexed = list(enumerate(prompts))
        else:
            indexed = [(i, ids, imgs) for i, (ids, imgs) in enumerate(zip(prompts, images))]
        chunks = {i: indexed[c.start : c.stop] for i, c in enumerate(contiguous_chunks(len(prompts), len(self)))}
        return self._on_engines(EngineActor.generate, chunks, sampling)

    def generate_requests(self, per_engine: dict[int, list[GenerationRequest]], sampling: SamplingSpec) -> list:
        """Requests on the engines named (EngineActor.generate_requests): {engine index: its requests} -> their
        rollouts, by engine then request; a lost engine's requests as generate's chunks."""
        return self._on_engines(EngineActor.generate_requests, per_engine, sampling)

    def _on_engines(self, fn: Callable, chunks: dict[int, list], sampling: SamplingSpec) -> list[Rollout]:
        pending = {i: chunk for i, chunk in chunks.items() if chunk}
        name = method_name(ROLE, EngineActor, fn)
        parts: dict[int, list[Rollout]] = {}
        while pending:
            refs = [getattr(self._engines[i], name).remote(chunk, sampling) for i, chunk in pending.items()]
            actors = [self._engines[i] for i in pending]
            call = GroupCall(ROLE, "generate", refs, list(pending), self.timeout_s, actors=actors, hang_s=self.hang_s)
            results, lost, failed = settle(call, self.timeout_s)
            if failed:  # the engine raised: not a loss a new engine would cure
                raise next(iter(failed.values()))
            parts.update(results)
            if lost and self.on_lost is None:
                raise next(iter(lost.values()))
            if lost:
                self.on_lost(lost, "generate")
            pending = {i: pending[i] for i in lost}
        return [r for i in sorted(parts) for r in parts[i]]

    def kill(self, index: int) -> None:
        """Kill engine `index`'s process (a hung one: its calls then fail as a dead engine's); replace() starts a
        new one."""
        ray.kill(self._engines[index], no_restart=True)

    def replace(self, index: int) -> int:
        """Kill engine `index` (dead or hung) and start a new one on its bundles, with its index (its seed); waits
        until the model is loaded. Returns the new engine's pid. Its weights are the model folder's until a sync.
        A new engine whose process dies while starting is started again (up to START_TRIES in all), once its
        placement group is placed: a lost node's bundles move to another node only after Ray has noticed the loss
        (seconds), and an engine sent to the lost node before that dies with it."""
        self.kill(index)
        slot, deadline = self._slots[index], time.monotonic() + self.timeout_s
        for attempt in range(1, START_TRIES + 1):
            if slot.placement_group is not None:
                wait_placed(slot.placement_group, max(1.0, deadline - time.monotonic()))
            self._engines[index] = self._spawn(index, slot)
            self._started[index] = self._engines[index].pid.remote()
            try:
                left = max(1.0, deadline - time.monotonic())
                return wait_all([self._started[index]], [index], ROLE, "start", left)[0]
            except RankError as e:
                if not e.died or attempt == START_TRIES:
                    raise
                lines = str(e).splitlines()  # Ray's own line on a lost node says more than "died unexpectedly"
                node = [x.strip() for x in lines if "node" in x and ("died" in x or "dead" in x)]
                why = node[:1] or lines[1:2] or [type(e).__name__]  # else the line after "... failed in start():"
                log.warning(
                    "vllm engine %d died while starting (%s); starting it again in %d s (try %d of %d)",
                    index,
                    why[0][:200],
                    RESTART_WAIT_S * attempt,
                    attempt + 1,
                    START_TRIES,
                )
                time.sleep(RESTART_WAIT_S * attempt)

    def dead(self, timeout_s: float = 10.0) -> dict[int, Exception]:
        """{engine index: its error} of the engines whose process is gone: died, or hung (a health check; one busy
        with a long call still answers: pid() has a thread of its own)."""
        call = GroupCall(ROLE, "pid", [e.pid.remote() for e in self._engines], list(range(len(self))), timeout_s)
        return health_check(call, timeout_s)

    def generate_turns(self, index: int, requests: list):
        """Agents' turns on engine `index` (EngineActor.generate_tokens) -> a concurrent.futures.Future."""
        return self.call_rank(index, EngineActor.generate_tokens, requests).future()

    # ---- calls (method references, orlhf/distributed/endpoints.py): the same API as distributed.groups.ActorGroup ----
    def call(self, fn: Callable, *args, **kwargs) -> GroupCall:
        """Call `fn` on every engine; .get() gives the results in engine order (an extension method: a list
        per engine, one result per TP worker)."""
        return self._call(fn, None, args, kwargs)

    def call_rank(self, index: int, fn: Callable, *args, **kwargs) -> GroupCall:
        """Call `fn` on engine `index` only."""
        return self._call(fn, [index], args, kwargs)

    def _call(self, fn: Callable, indices: Optional[list[int]], args: tuple, kwargs: dict) -> GroupCall:
        extension = _defined_in(WeightSyncExtension, fn)  # runs in the engine's vLLM workers
        name = method_name(ROLE, WeightSyncExtension if extension else EngineActor, fn)  # checked before sending
        indices = list(range(len(self._engines))) if indices is None else indices
        if extension:
            refs = [self._engines[i].collective_rpc.remote(name, args, kwargs) for i in indices]
        else:
            refs = [getattr(self._engines[i], name).remote(*args, **kwargs) for i in indices]
        actors = [self._engines[i] for i in indices]
        return GroupCall(ROLE, name, refs, indices, self.timeout_s, actors=actors, hang_s=self.hang_s)

    # ---- CUDA IPC weight hand-over (IpcWeightSync): called by an actor rank on its one engine's subset ----
    def ipc_begin(self) -> None:
        """Open one layerwise reload on every vLLM worker (workers/weight_send.py: send_ipc)."""
        self.call(WeightSyncExtension.orlhf_ipc_begin).get()

    def load_ipc(self, names: list[str], handles: dict) -> None:
        """Load one parameter group from CUDA IPC handles keyed by GPU UUID; returns once copied."""
        self.call(WeightSyncExtension.orlhf_load_ipc, names, handles).get()

    def ipc_finish(self) -> None:
        """Close the reload opened by ipc_begin."""
        self.call(WeightSyncExtension.orlhf_ipc_finish).get()

    def subset(self, indices: Sequence[int]) -> "EngineGroup":
        """A group of some of these engines (the same actors), e.g. the one engine an actor rank feeds over
        CUDA IPC; it can be passed to another Ray actor. Shutting it down is the full group's job."""
        sub = object.__new__(EngineGroup)
        sub.cfg, sub.timeout_s, sub.tuning, sub._started = self.cfg, self.timeout_s, self.tuning, []
        sub.hang_s = self.hang_s
        sub._engines, sub._slots, sub.on_lost = [self._engines[i] for i in indices], [], None
        return sub

    def shutdown(self) -> None:
        for e in self._engines:
            ray.kill(e, no_restart=True)
        self._engines = []


def contiguous_chunks(n: int, engines: int) -> list[range]:
    """Engine i's prompt indices of a batch of n: ceil(n / engines) each, the last ones shorter or empty."""
    per = -(-n // engines)
    return [range(min(i * per, n), min((i + 1) * per, n)) for i in range(engines)]


def _defined_in(cls: type, fn: Callable) -> bool:
    name = getattr(fn, "__name__", None)
    return name is not None and any(vars(k).get(name) is fn for k in cls.__mro__)
