"""CPU runs' model groups: rank processes that may host another role's workers (hosting_rules.host_of), driven in
turn.

    cpu_group("actor", PolicyWorker, cfg, slots, guests=["ref"])   an ActorGroup of CpuRankActors, as a CpuGroup
    actor.host("ref", ReferenceWorker, cfg)                        ref's workers in the actor's rank processes:
                                                                    rank k's in actor rank k's process
    actor.host("critic", CriticWorker, cfg, beside=(CriticWorker.values, CriticWorker.train_step))
    group.call / call_rank / call_sharded -> GroupCall             the call API of every group (groups.Calls)
    group.set_cpu_threads(n), group.processes                      for the per-phase thread plan (cpu/threads.py)
    model_groups(cfg, spawn, worker_of, stack)                     a run's groups (CpuTuning.model_groups)

Why hosting: a process of its own costs a frozen model a Ray worker plus torch, transformers and DeepSpeed
imports and their memory, before the first step (hosting_rules.host_of says which role goes where).

Invariants (the rank side: cpu/rank_actor.py):
- A process that holds several workers (a host and its guests) runs their calls one at a time, in the order the
  driver numbered them (one counter per rank, numbered for all ranks of a call at once: Turns): both workers use
  the process's one torch.distributed group, so two ranks must never run the host's and the guest's collectives
  in different orders. Numbering starts when the first guest is hosted, before any call is made.
- A guest's calls run on its own RNG states (swapped in and out), so the host's random numbers are exactly those
  it would draw alone in its process; its shutdown leaves the processes to the host.
- One exception: the methods a guest is hosted with as `beside` run, on a one-rank host, at once on a pool
  thread beside the host's call, unnumbered and without the RNG swap. Only methods that draw no random numbers
  (async mode's reference scored ahead; the hosted critic's values and train steps, whose model has no dropout:
  hosting_rules.host_of): a single rank has no peer to interleave collectives with, and what draws nothing leaves the
  host's random numbers as they were. With more ranks they are numbered like any call.
"""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from typing import Any, Callable, Optional, Sequence

from orlhf.config.roles import ROLES, active_roles
from orlhf.cpu.hosting_rules import guest_roles, runs_beside
from orlhf.cpu.rank_actor import CpuRankActor
from orlhf.distributed.endpoints import check_exports, method_name
from orlhf.distributed.groups import ActorGroup, Calls, GroupCall, spawn_groups, wait_all
from orlhf.workers import CriticWorker, ReferenceWorker, RewardWorker

log = logging.getLogger("orlhf")


class Turns:
    """The driver's per-rank call counters for processes that host several workers (CpuRankActor.in_turn)."""

    def __init__(self, world_size: int):
        self.lock = threading.Lock()  # held while one group call numbers all its ranks
        self.next = [0] * world_size

    def take(self, rank: int) -> int:
        n = self.next[rank]
        self.next[rank] += 1
        return n


class CpuGroup(Calls):
    """One role's workers on the CpuRankActors of `base` (an ActorGroup): that group's own role, or, made by
    host(), a guest role's workers in its host's processes. The same call API as ActorGroup."""

    def __init__(
        self,
        base: ActorGroup,
        role: Optional[str] = None,
        worker_cls: Optional[type] = None,
        *,
        guests: Sequence[str] = (),
        host: Optional["CpuGroup"] = None,
        beside: Sequence[Callable] = (),
    ):
        self.base, self.role = base, role or base.role
        self.worker_cls = worker_cls or base.worker_cls
        self.world_size, self.timeout_s, self.actors = base.world_size, base.timeout_s, base.actors
        self.hang_s = getattr(base, "hang_s", None)  # None: no health checks (heartbeat.py)
        self.guests, self.host_group = tuple(guests), host  # guests: the roles it has room for (a host only)
        self.host_role = host.role if host is not None else None
        self.turns: Optional[Turns] = None  # a host's, from its first guest on; a guest reads its host's
        self.beside = frozenset(method_name(self.role, self.worker_cls, fn) for fn in beside)

    def host(self, role: str, worker_cls: type, cfg: Any, beside: Sequence[Callable] = ()) -> "CpuGroup":
        """`role`'s workers in this group's rank processes, rank k's in rank k's process, as a group of its own
        (same calls; errors name `role` and the host). Needs `role` among the guests this group was built for.
        From here on every call to these processes is numbered (module docstring). `beside`: its methods that
        run beside the host's call on a one-rank host."""
        if role not in self.guests:
            raise ValueError(f"{self.role}: built without room for guest {role!r} (guests={self.guests})")
        check_exports(role, worker_cls)
        if self.turns is None:
            self.turns = Turns(self.world_size)
        guest = CpuGroup(self.base, role, worker_cls, host=self, beside=beside)
        setups = [a.setup_guest.remote(role, worker_cls, cfg) for a in self.actors]
        wait_all(setups, list(range(self.world_size)), role, "setup", self.timeout_s, self.role)
        return guest

    # ---- calls (method references, orlhf/distributed/endpoints.py) --------------------------------------------------
    def _submit(self, name: str, ranks: list[int], args: list[tuple], kwargs: dict) -> GroupCall:
        """Start `name` on `ranks` (args[i] for ranks[i]); numbered for all of them at once when hosting."""
        turns = self.host_group.turns if self.host_group is not None else self.turns
        if turns is None:
            refs = [self.actors[r].call_as.remote(self.role, name, None, *a, **kwargs) for r, a in zip(ranks, args)]
        else:
            with turns.lock:
                refs = [
                    self.actors[r].call_as.remote(self.role, name, turns.take(r), *a, **kwargs)
                    for r, a in zip(ranks, args)
                ]
        actors = [self.actors[r] for r in ranks]
        return GroupCall(self.role, name, refs, ranks, self.timeout_s, host=self.host_role, **self._health(actors))

    def call_sharded(self, fn: Callable, batch: Any, *args, **kwargs) -> GroupCall:
        """As ActorGroup.call_sharded; a `beside` method on a one-rank host runs beside its call in flight
        (CpuRankActor.call_beside, on the whole batch), unnumbered."""
        name = method_name(self.role, self.worker_cls, fn)
        if name not in self.beside or self.world_size != 1:
            return super().call_sharded(fn, batch, *args, **kwargs)
        ref = self.actors[0].call_beside.remote(self.role, name, batch, *args, **kwargs)
        out = GroupCall(self.role, name, [ref], [0], self.timeout_s, host=self.host_role, **self._health(self.actors))
        out.n_out = len(batch)
        return out

    def _health(self, actors: list) -> dict:
        """GroupCall's health-check arguments (distributed/heartbeat.py) for calls on `actors`."""
        return {"actors": actors, "hang_s": self.hang_s}

    def set_cpu_threads(self, n: int) -> None:
        """Every rank runs this role's next calls with n torch threads (per phase: cpu/threads.py)."""
        wait_all(
            [a.set_cpu_threads.remote(n, self.role) for a in self.actors],
            list(range(self.world_size)),
            self.role,
            "set_cpu_threads",
            self.timeout_s,
            self.host_role,
        )

    def pids(self) -> list[int]:
        ranks = list(range(self.world_size))
        return wait_all([a.pid.remote() for a in self.actors], ranks, self.role, "pid", self.timeout_s, self.host_role)

    @property
    def processes(self) -> list:
        """One key per rank process, for cpu/threads.py's count: a guest's are its host's, unless it trains (the
        critic: its values and train steps run beside the host's calls, hosting_rules.runs_beside), then one of its
        own."""
        apart = self.host_group is not None and self.role in ROLES and ROLES[self.role].trains
        return [(id(a), self.role) if apart else id(a) for a in self.actors]

    def shutdown(self) -> None:
        """Kill the rank actors; a guest only lets go of them (its host's shutdown kills them)."""
        if self.host_group is None:
            self.base.shutdown()
        self.actors = []


def cpu_group(role: str, worker_cls: type, cfg: Any, slots: Sequence, *, guests: Sequence[str] = (), **kwargs):
    """ActorGroup(role, worker_cls, cfg, slots, **kwargs) on CpuRankActors with room for `guests`, as a CpuGroup."""
    return CpuGroup(ActorGroup(role, worker_cls, cfg, slots, **rank_options(len(guests)), **kwargs), guests=guests)


def rank_options(guests: int) -> dict:
    """ActorGroup options for CPU rank processes hosting `guests` roles: a guest's calls wait for their turn on a
    pool thread (module docstring), so room for two more calls per guest."""
    return {"actor_cls": CpuRankActor, "concurrency": 2 + 2 * guests}


def beside_calls(cfg, role: str) -> tuple:
    """The methods of hosted `role` that run beside its host's calls (module docstring): a hosted critic's values
    and train steps (hosting_rules.runs_beside); in async mode the frozen models' forwards scored ahead
    (trainer/scoring.Scorer.ahead), the only place they are called there."""
    if runs_beside(cfg, role):
        return (CriticWorker.values, CriticWorker.train_step)
    if cfg.ppo.async_train:
        return {"ref": (ReferenceWorker.log_probs,), "reward": (RewardWorker.scores,)}.get(role, ())
    return ()


def model_groups(cfg, spawn: Callable[..., ActorGroup], worker_of: Callable[[str], tuple], stack: ExitStack) -> dict:
    """A CPU run's groups by role (Tuning.model_groups): the roles of their own processes spawned at once on
    CpuRankActors, then each guest (hosting_rules.host_of) hosted in its host's, after it, so that its init() is
    numbered after the host's in every process."""
    guests = guest_roles(cfg)  # the ref in the actor's processes on CPU

    def spawn_cpu(role: str) -> ActorGroup:
        return spawn(role, **rank_options(sum(host == role for host in guests.values())))

    own = [role for role in active_roles(cfg) if role not in guests]
    groups: dict[str, Any] = {
        role: CpuGroup(g, guests=[guest for guest, host in guests.items() if host == role])
        for role, g in spawn_groups(own, spawn_cpu, stack).items()
    }
    for role, host in guests.items():
        groups[role] = groups[host].host(role, *worker_of(role), beside=beside_calls(cfg, role))
        log.info(
            "%s: %d rank(s) inside the %s's rank processes%s, pids %s (CPU; --%s_own_process gives it "
            "processes of its own)",
            role,
            groups[role].world_size,
            host,
            ", its calls beside the " + host + "'s" if runs_beside(cfg, role) else "",
            groups[role].pids(),
            role,
        )
    return groups
