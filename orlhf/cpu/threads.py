"""CPU threads handed over per phase: the model ranks that work in a phase share all the machine's cores.

    Controller.timed(phase) --> PhaseThreads.before(phase)          (CpuTuning.phases: --device cpu only)
        score      the ranks that score: actor (old log-probs), ref, critic, reward   cores // processes working
        train      actor (+ critic) ranks                                              (at least 1 each)
        generate   the engines, set once at their start (engine_threads): cores // engines in sync mode; with
                   --rollout_backend trainer the actor's ranks, handed over like the other phases
    CpuGroup.set_cpu_threads(n) stores n for that role's worker in its rank processes (cpu/hosting.py); every later
    call of it applies n on the thread that runs the work (cpu/rank_actor.py).

Processes, not groups: on CPU the reference runs inside the actor's rank processes (hosting_rules.host_of), and a
process runs its workers' calls one at a time (cpu/hosting.py), so actor + hosted ref in the score phase count once
per rank. A hosted critic's calls run beside the actor's (hosting_rules.runs_beside), so it counts as a process of
its own.

Why per phase: with one thread per Ray process (Ray sets OMP_NUM_THREADS to the actor's CPU slots, 1 here) a phase
in which one rank works (GRPO with one optimizer step per batch: the ref scores alone, the actor trains alone)
leaves the other cores idle; with N threads everywhere, phases in which several ranks work oversubscribe the
cores and OpenMP teams wait at barriers for descheduled threads.

Why "on the thread that runs the work": torch's OpenMP thread count is per calling thread (libgomp keeps it in
the thread's own ICV once a thread has run torch code). A rank actor runs every worker call on one compute thread
of its own (CpuRankActor.call_as), and the count is applied there. One thread matters as much as the count: each
thread that runs a multi-threaded op gets its own OpenMP team, and once libgomp manages more threads than there
are cores its idle team threads spin only briefly before sleeping on a futex, to be woken again around every op:
calls spread over Ray's pool threads make a train step slower and switch context far more often.

The engines get their count once, before vLLM starts (its CPU worker refuses set_num_threads afterwards), from
engine_threads(): in sync mode they work alone in the generate phase (the ranks wait for the rollouts), so they
share the cores, cores // (engines x tensor-parallel size); with --async_train generation runs beside training
all the time and each engine keeps one thread per CPU slot (Ray's OMP_NUM_THREADS); --vllm_cpu_threads N sets N.
Generation on CPU is mostly serial Python (vLLM's scheduler, sampler and output processing:
benchmarks/results/2026-11-23-engine-generation.md),
so a second thread gains less than a second rank would; more engines (--vllm_num_engines) fill the cores with
whole processes instead.

Idle processes do not spin: libgomp's threads spin only briefly after a parallel region and then sleep, so no
OMP_WAIT_POLICY is set (PASSIVE would put the working team to sleep between every op).

The counts follow from the flags and the machine's cores alone, never from its load, so a seeded run gives the
same numbers on a busy machine (the thread count changes floating-point summation order). On a machine shared
with other jobs, teams larger than the free cores wait at every barrier for a descheduled thread: there, pass
--train_cpu_threads 1.

Off: on GPUs (the plain Tuning hands nothing over); with --async_train (generation runs beside training all the
time) nothing is handed over; a fixed --train_cpu_threads N is sent the same way (also in async mode), so that it
reaches every pool thread.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

log = logging.getLogger(__name__)


NICENESS_ENV = "RAY_worker_niceness"  # read by the raylet as it starts (its worker_niceness setting)


def cluster_priority_env() -> dict[str, str]:
    """Environment for the processes of a local CPU cluster orlhf starts: its workers at the user's priority
    (niceness 0), not Ray's default 15; a value the user set is theirs and stays.

    Why: Ray lowers its workers so that the raylet and the driver stay responsive beside them. On a CPU run the
    workers are the compute: a rank's OpenMP team spans the cores and waits at the end of every op for its
    slowest thread. At niceness 15 any niceness-0 process that wakes (the driver, Ray's own processes, another job
    on the machine) takes a core from a team thread at once, and the whole team then waits for that thread. The
    frozen models' forwards, short ops one after another, lost most: on a 2-core machine the reference's forward
    took about twice its time alone (benchmarks/results/ has the measurements). A trainer in one process (TRL)
    runs at the user's priority too."""
    return {} if NICENESS_ENV in os.environ else {NICENESS_ENV: "0"}


def machine_cores() -> int:
    """Cores this process may run on (the driver's; a CPU run's processes share one machine's cores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def apply_threads(n: int) -> None:
    """torch's intra-op threads of the calling thread = n (changed only when different: a change may rebuild
    torch's pthreadpool)."""
    import torch

    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def engine_threads(cfg, cores: Optional[int] = None) -> int:
    """Torch threads per engine on CPU (0: leave Ray's OMP_NUM_THREADS, one per CPU slot the engine holds): the
    user's --vllm_cpu_threads; else, in sync mode, the engines' share of the cores (they work alone while they
    generate); with --async_train 0 (the trainers work beside them). GPUs: 0 (unused)."""
    v = cfg.vllm
    if cfg.runtime.device != "cpu" or v.cpu_threads:
        return v.cpu_threads
    if cfg.ppo.async_train:
        return 0
    return share(cores or machine_cores(), max(1, cfg.num_engines) * v.tensor_parallel_size)


def threads_as_ray_set() -> None:
    """In a worker that imported torch before this actor (the preload, cpu/preload.py, or an earlier task or
    actor class of a worker Ray reuses), apply the OMP_NUM_THREADS Ray set for this actor: torch fixed its thread
    count at import, before Ray set the variable, and would otherwise keep it (every core, or what the earlier work
    had). Called as an actor starts (CpuRankActor, CpuTuning.engine_start); the count then holds on every thread of
    the process (torch keeps it process-wide once set). Nothing in a worker without torch yet: torch reads the
    variable when it is imported."""
    if "torch" not in sys.modules:
        return
    n = os.environ.get("OMP_NUM_THREADS", "")
    if n.isdigit() and int(n) > 0:
        apply_threads(int(n))


def share(cores: int, processes: int) -> int:
    """Threads per process when `processes` work at once on `cores` (at least 1)."""
    return max(1, cores // max(1, processes))


def processes(groups) -> int:
    """Distinct processes among the groups' ranks: a guest group's ranks are its host's processes
    (CpuGroup.processes gives one key per rank process; a group without it has processes of its own)."""
    keys = set()
    for g in groups:
        keys.update(getattr(g, "processes", None) or [(id(g), rank) for rank in range(g.world_size)])
    return len(keys)


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
        actor_scores = not cfg.single_pass or cfg.reference_from_actor  # old log-probs, or LoRA's base ones
        scoring = ([models.actor] if actor_scores else []) + [models.ref, models.critic, models.reward]
        training = [models.actor, models.critic]
        phases = {"score": [g for g in scoring if g is not None], "train": [g for g in training if g is not None]}
        generating = list(models.rollout.generating_groups)  # model groups that generate: the phase's cores
        if generating:
            phases["generate"] = generating
        # --train_cpu_threads N: sent like a hand-over (init() set it on one of a rank's pool threads only)
        n = cfg.deepspeed.train_cpu_threads
        fixed = {id(g): n for g in phases["score"] + phases["train"]} if n else {}
        if cfg.ppo.async_train:  # generation runs beside training all the time: only the fixed counts are sent
            phases = {phase: [g for g in gs if id(g) in fixed] for phase, gs in phases.items()}
        plan = cls(phases, cores or machine_cores(), fixed)
        if generating:  # no engine of its own
            log.info("CPU threads per phase (%d cores): %s", plan.cores, plan.describe())
            return plan
        engines = engine_threads(cfg, plan.cores)
        log.info(
            "CPU threads per phase (%d cores): generate: %d engine(s) %s; %s",
            plan.cores,
            cfg.num_engines,
            engines or "as Ray sets",
            plan.describe(),
        )
        return plan

    def threads(self, phase: str, group) -> int:
        """The group's threads in `phase`."""
        if id(group) in self.fixed:
            return self.fixed[id(group)]
        return share(self.cores, processes(self.phases[phase]))

    def describe(self) -> str:
        """E.g. "score: ref 2; train: actor 2 (torch threads per rank)"."""
        return (
            "; ".join(
                f"{phase}: " + ", ".join(f"{getattr(g, 'role', '?')} {self.threads(phase, g)}" for g in gs)
                for phase, gs in self.phases.items()
                if gs
            )
            + " (torch threads per rank)"
        )

    def before(self, phase: str) -> None:
        """Send this phase's thread counts to its groups, waited for: a rank actor applies the stored count on
        the thread that runs each call, so it must be stored before the phase's call starts. Usually sent once: a
        group whose phases all give it the same count is not called again. The counts depend only on the run's
        flags and the machine's cores, never on its load: the thread count changes floating-point summation
        order, and a seeded run (and a resumed one) must give the same numbers whatever else runs on the
        machine."""
        for g in self.phases.get(phase, []):
            n = self.threads(phase, g)
            if self._last.get(id(g)) != n:
                g.set_cpu_threads(n)
                self._last[id(g)] = n
