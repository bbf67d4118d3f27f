"""--max_engine_restarts: a vLLM engine that dies, or misses the deadline of a generate, is replaced in place and the
step goes on.

    found lost                                    by
      generate: an engine's chunk died, its       EngineGroup.generate (rollout/engine_group.py) -> the backend's
        process hung (--hang_timeout_s), or it    on_lost = recover
        gave no answer within --ray_timeout_s
      weight sync: the broadcast failed, and an   EngineRestarts.sync -> EngineProcesses.lost_in_sync
        engine died in it                           (WeightSync.lost_engines: both sides' calls ended, the dead named)
    EngineRestarts.recover(lost, where)
      1. may it? past --max_engine_restarts, or where no engine is replaced (--async_train, CUDA IPC sync, NCCL
         during a sync): one line, then the engine's own error stops the run, as with --max_engine_restarts 0
      2. each lost engine killed and started again on its own bundles, with its own index and seed; awaited
      3. a fresh weight-sync group of every engine (EngineProcesses.reconnect: a group cannot take a new member)
      4. the current weights (the controller's weight_version) synced into every engine before any serves
    then generate sends the lost engines' chunks again: the same requests, seeded per prompt index
    (types.request_seed), on engines with the same weights, so a sync-mode run's metrics equal an undisturbed run's.

Not covered, each stopping the run as before with one line saying why: --async_train (the producer generates
while the actor trains, so the current weights are not at hand), agents' turns (--agent_func_path: an episode holds
its engine across turns), and CUDA IPC sync (each actor rank holds its engine's handle); there a lost engine's
process may still restart the whole run from its checkpoint (--max_restarts, launch/restart.py). The count is the
run's (kept in checkpoints, so a resume goes on with the budget left), shown as `engine_restarts` in every metrics
row.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from orlhf.rollout.backend import EngineProcesses

log = logging.getLogger(__name__)


def lost_reason(error: BaseException, timeout_s: float) -> str:
    """How an engine was lost, from its error: its process stopped answering health checks (RankError.hung), died
    (RankError.died), or its call gave no answer in time."""
    if getattr(error, "hung", False):
        return "stopped answering health checks (--hang_timeout_s)"
    return "died" if getattr(error, "died", False) else f"gave no answer within {timeout_s:.0f} s (--ray_timeout_s)"


class EngineRestarts:
    """Replaces lost engines (module docstring) of `rollout` (a RolloutBackend, rollout/backend.py). `progress()` ->
    (the step in progress, the current weight version), read when an engine is lost. `why_not`: where engines are
    never replaced, why (one line says so on a loss); `sync_why_not`: the same for an engine lost during a weight
    sync. `agents`: rollouts are agents' episodes."""

    def __init__(
        self,
        rollout,
        limit: int,
        progress: Callable[[], tuple[int, int]],
        why_not: Optional[str] = None,
        sync_why_not: Optional[str] = None,
        agents: bool = False,
    ):
        self.rollout, self.limit, self.progress = rollout, limit, progress
        self.why_not, self.sync_why_not, self.agents = why_not, sync_why_not, agents
        self.hooked = False  # the backend calls recover when it loses an engine (EngineProcesses.on_lost)
        self.count = 0  # engines replaced so far

    @classmethod
    def for_run(cls, cfg, models, progress: Callable[[], tuple[int, int]]) -> "EngineRestarts":
        """The run's restarts, hooked into its rollout backend (EngineProcesses.on_lost) when that has members of their
        own (vLLM engines); where the actor's ranks generate, nothing is hooked."""
        rollout = models.rollout
        engines = isinstance(rollout, EngineProcesses)  # members of their own, replaceable one by one
        why_not = None
        if not engines:
            why_not = f"the {rollout.kind} rollout backend has no engines of its own to replace"
        elif cfg.ppo.async_train:
            why_not = "--async_train generates while the actor trains; engines are replaced in sync mode only"
        else:
            why_not = rollout.why_not_replaceable()
        sync_why_not = None
        if cfg.vllm.sync_backend == "nccl":
            sync_why_not = "an engine lost during an NCCL weight sync may leave the actor's stream waiting on it"
        restarts = cls(
            rollout,
            cfg.vllm.max_engine_restarts,
            progress,
            why_not,
            sync_why_not,
            agents=bool(cfg.data.agent_func_path),
        )
        if engines:
            rollout.on_lost, restarts.hooked = restarts.recover, True
        return restarts

    def recover(self, lost: dict, where: str, why_not: Optional[str] = None) -> None:
        """`lost`: {engine index: its error} lost in `where`. Replace them and load the current weights, or raise
        the first one's error (the run stops naming the engine, as it did before restarts)."""
        step, version = self.progress()
        timeout_s = self.rollout.timeout_s
        what = "; ".join(f"vllm engine {i} {lost_reason(e, timeout_s)}" for i, e in sorted(lost.items()))
        why_not = self.why_not or why_not
        if why_not is None and self.count + len(lost) > self.limit:
            why_not = f"--max_engine_restarts {self.limit}" + (f", {self.count} used" if self.limit else "")
        if why_not is not None:
            log.error("step %d: %s during %s; not replaced: %s", step, what, where, why_not)
            raise lost[min(lost)]
        log.warning(
            "step %d: %s during %s; replacing it on its bundles (engine restart %d of --max_engine_restarts %d)",
            step,
            what,
            where,
            self.count + len(lost),
            self.limit,
        )
        t0 = time.perf_counter()
        pids = {i: self.rollout.replace(i) for i in sorted(lost)}
        self.rollout.reconnect()
        self.rollout.load_weights(version)
        self.count += len(lost)
        log.warning(
            "step %d: %s replaced in %.1f s (pid %s) and loaded with weight version %d; %s",
            step,
            ", ".join(f"vllm engine {i}" for i in pids),
            time.perf_counter() - t0,
            ", ".join(map(str, pids.values())),
            version,
            "its prompts are generated again" if where == "generate" else "the step goes on",
        )

    def sync(self, version: int) -> None:
        """The controller's weight sync. An engine that died in it is replaced (recover, which syncs again); with a
        sync that cannot say which (CUDA IPC), a health check names the dead engine before the run stops."""
        try:
            self.rollout.load_weights(version)
        except Exception as e:
            if not self.hooked:
                raise
            hung = getattr(e, "hung", False) and getattr(e, "role", "").startswith("vllm")
            if hung:
                self.rollout.kill(e.rank)  # its receive would never end: killed, the actor's broadcast fails at once
            lost = self.rollout.lost_in_sync()
            if not lost:
                raise
            if hung and e.rank in lost:
                lost[e.rank] = e  # it hung and was killed for it: say so, not that it died
            self.recover(lost, "the weight sync", self.sync_why_not)

    def generate(self, fn: Callable, *args):
        """The executor's generate. Agents' episodes (--agent_func_path) do not replace an engine that dies under
        them (an episode holds its engine across turns): a health check names it in one line before its error stops
        the run."""
        if not (self.agents and self.hooked):
            return fn(*args)
        try:
            return fn(*args)
        except Exception:
            dead = self.rollout.dead()
            if dead:
                what = "; ".join(f"vllm engine {i} died" for i in sorted(dead))
                log.error(
                    "step %d: %s during agent episodes; not replaced: an episode holds its engine across turns",
                    self.progress()[0],
                    what,
                )
            raise
