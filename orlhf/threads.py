"""CPU threads handed over per phase: the processes that work in a phase share all the machine's cores.

    Controller.timed(phase) --> PhaseThreads.before(phase)          (sync mode, --device cpu only)
        generate   engines                          cores // engines torch threads each
        score      the ranks that score: actor (old log-probs), ref, critic, reward
        train      actor (+ critic) ranks           cores // ranks working (at least 1)
        other phases: nothing changes (sync, make_experience: brief, or driver work)
    RankActor.set_cpu_threads(n) / EngineActor.set_cpu_threads(n) store n; the next call applies it on the thread
    that runs the work (apply_threads), then returns.

Why per phase: with one thread per Ray process (Ray sets OMP_NUM_THREADS to the actor's CPU slots, 1 here) a phase
in which one process works leaves the other cores idle; with N threads everywhere, phases in which several
processes work oversubscribe the cores and OpenMP teams wait at barriers for descheduled threads.

Why "on the thread that runs the work": torch's OpenMP thread count is per calling thread (libgomp keeps it in
the thread's own ICV once a thread has run torch code), and a rank actor runs calls on a pool of threads
(max_concurrency=2), so a set_num_threads in one call (e.g. init()) need not reach the thread that trains. And in
an engine, in-process vLLM replaces torch.set_num_threads with a no-op (its CPU worker), so the C call is used.

Idle processes do not spin: libgomp's threads spin only briefly after a parallel region and then sleep
(benchmarks/README.md: <= 0.8% of a 1-thread phase's samples in libgomp, 0.1-3.6 ms of CPU in the second after a
2-thread region), so no OMP_WAIT_POLICY is set (PASSIVE would put the working team to sleep between every op).

Off (nothing handed over): on GPUs, with --async_train (generation runs beside training all the time), and for a
role whose thread count the user fixed (--train_cpu_threads / --vllm_cpu_threads N keep N; a fixed
--train_cpu_threads is sent the same way, also in async mode, so that it reaches every pool thread).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger(__name__)


def machine_cores() -> int:
    """Cores this process may run on (the driver's; a CPU run's processes share one machine's cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def apply_threads(n: int) -> None:
    """torch's intra-op threads of the calling thread = n (changed only when different: a change may rebuild
    torch's pthreadpool). torch._C.set_num_threads (the builtin torch.set_num_threads is bound to): vLLM's CPU worker replaces the Python wrapper."""
    import torch

    if n > 0 and torch.get_num_threads() != n:
        torch._C.set_num_threads(n)


def share(cores: int, processes: int) -> int:
    """Threads per process when `processes` work at once on `cores` (at least 1)."""
    return max(1, cores // max(1, processes))


def processes(group) -> int:
    """Processes in a model group (ActorGroup: its ranks) or an EngineGroup (its engines; TP is GPU-only)."""
    return getattr(group, "world_size", None) or len(group)


class PhaseThreads:
    """Before each phase, tells the processes that work in it how many threads to use (see the module doc)."""

    def __init__(self, phases: dict[str, list], cores: int, fixed: Optional[dict[int, int]] = None):
        self.phases, self.cores = phases, cores  # phase -> [groups working in it]
        self.fixed = fixed or {}  # id(group) -> threads the user fixed (--train_cpu_threads)
        self._last: dict[int, int] = {}  # id(group) -> threads last sent (no call when unchanged)

    @classmethod
    def from_config(cls, cfg, models, cores: Optional[int] = None) -> "PhaseThreads":
        """The plan for a run; empty (before() does nothing) where nothing is handed over."""
        if cfg.runtime.device != "cpu":
            return cls({}, 1)
        scoring = ([] if cfg.single_pass else [models.actor]) + [models.ref, models.critic, models.reward]
        training = [models.actor, models.critic]
        # --vllm_cpu_threads N: the engine set N before vLLM started, on the thread that runs its calls: leave it
        engines = [models.engines] if not cfg.vllm.cpu_threads else []
        phases = {"generate": engines, "score": [g for g in scoring if g is not None],
                  "train": [g for g in training if g is not None]}
        # --train_cpu_threads N: sent like a hand-over (init() set it on one of a rank's pool threads only)
        n = cfg.deepspeed.train_cpu_threads
        fixed = {id(g): n for g in phases["score"] + phases["train"]} if n else {}
        if cfg.ppo.async_train:  # generation runs beside training all the time: only the fixed counts are sent
            phases = {phase: [g for g in gs if id(g) in fixed] for phase, gs in phases.items()}
        plan = cls(phases, cores or machine_cores(), fixed)
        log.info("CPU threads per phase (%d cores): %s", plan.cores, plan.describe())
        return plan

    def threads(self, phase: str, group) -> int:
        return self.fixed.get(id(group)) or share(self.cores, sum(processes(g) for g in self.phases[phase]))

    def describe(self) -> str:
        return "; ".join(f"{phase}: " + ", ".join(f"{processes(g)} x {self.threads(phase, g)}" for g in gs)
                         for phase, gs in self.phases.items() if gs)

    def before(self, phase: str) -> None:
        """Send this phase's thread counts to its groups, waited for: a rank actor runs calls on a pool of
        threads, so the count must be stored before the phase's call starts. Usually sent once: a group whose
        phases all give it the same count is not called again."""
        for g in self.phases.get(phase, []):
            n = self.threads(phase, g)
            if self._last.get(id(g)) != n:
                g.set_cpu_threads(n)
                self._last[id(g)] = n
