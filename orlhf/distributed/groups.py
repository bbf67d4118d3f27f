"""ActorGroup: one model role as N rank actors on their placement-group bundles.

    driver                                 Ray
    ActorGroup("actor", PolicyWorker, cfg, slots)    slots: placement.RankBundle per rank
      |-- RankActor(rank 0) on slot 0  --> PolicyWorker(cfg) with MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
      |-- RankActor(rank 1) on slot 1  --> ...
    group.call(PolicyWorker.init).get()                  every rank, same args (collectives: all ranks enter)
    group.call_sharded(PolicyWorker.log_probs, batch)    batch split over ranks -> GroupCall; .get_cat() gathers
    group.call_rank(0, PolicyWorker.sync_address)        one rank
    ref.call_sharded_beside(ReferenceWorker.log_probs, b)  a hosted frozen forward beside its one-rank host's call
    wait_calls(call_a, call_b)                           several calls (of any groups) waited on together
    actor.host("ref", ReferenceWorker, cfg)             (CPU, roles.host_of) a group whose workers live in the
                                                         actor's rank processes: rank k's in actor rank k's

Calls name the method by reference (orlhf/distributed/endpoints.py): it must be an @endpoint of the group's worker
class,
checked before anything is sent. Every call starts at once and returns a GroupCall; .get() waits. The engines'
group (rollout/engine.py) has the same call / call_rank and returns the same GroupCall.

Invariants:
- Every wait has a timeout; a timeout names the role, method and the ranks still running.
- The first rank that fails ends the wait at once (its peers may be stuck in a collective waiting for it):
  the error names role, rank, method and carries the remote traceback.
- ZeRO-3 forwards are collective, so every rank must run the same number of micro-batches: call_sharded
  pads the batch to a multiple of the world size (repeating the last row) and trims the results.
- A process that holds several workers (a host and its guests) runs their calls one at a time, in the order the
  driver numbered them (one counter per rank, numbered for all ranks of a call at once): both workers use the
  process's one torch.distributed group, so two ranks must never run the host's and the guest's collectives in
  different orders. A guest's calls run on its own RNG states (swapped in and out), so the host's random
  numbers are exactly those it would draw alone in its process; its shutdown leaves the processes to the host.
  One exception, for calls that draw no random numbers on a one-rank host (call_sharded_beside: async mode's
  reference scored ahead; the hosted critic's values and train steps, whose model has no dropout: roles.host_of):
  they run at once on a pool thread beside the host's call, unnumbered and without the RNG swap, since a single
  rank has no peer to interleave collectives with, and what draws nothing leaves the host's random numbers as
  they were.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Optional, Sequence

import ray
import torch

from orlhf.cpu.threads import apply_threads, threads_as_ray_set
from orlhf.distributed.endpoints import check_exports, method_name
from orlhf.distributed.placement import RankBundle, scheduling_options
from orlhf.storage.logs import LOG_DIR_ENV, redirect_output, tail, worker_log_path

log = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A rank actor raised or died. `role`, `rank` and `method` say where; the message holds the traceback."""

    def __init__(self, role: str, rank: int, method: str, detail: str, died: bool = False, host: Optional[str] = None):
        self.role, self.rank, self.method = role, rank, method
        detail = re.sub(r"\x1b\[[0-9;]*m", "", detail)  # Ray colours its task names
        path = worker_log_path(log_name(host or role, rank))  # a guest writes to its host's log
        if path is not None:
            last = tail(path) if died else ""  # no traceback travelled: show what the process printed last
            detail += f"\nlast lines of {path}:\n{last}" if last else f"\nits full output: {path}"
        where = f" (in {host} rank {rank}'s process)" if host else ""
        super().__init__(f"{role} rank {rank} failed in {method}(){where}:\n{detail}")


def log_name(role: str, rank: int) -> str:
    """The log file name (storage/logs.py) of a rank or engine: actor-0, critic-1, vllm-0."""
    return f"{'vllm' if role.startswith('vllm') else role}-{rank}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rng_states() -> tuple:
    """The process's global RNG states a worker draws from (CPU only: guests exist on CPU only)."""
    import numpy as np

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_rng_states(states: tuple) -> None:
    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


@ray.remote
class RankActor:
    """Holds this rank's workers keyed by role: its own (`role`) and guests (ActorGroup.host); the group calls
    their methods by name. No logic of its own beyond the turn order and RNG swap of the module docstring."""

    def __init__(self, role: str, rank: int, env: dict[str, str]):
        # No automatic garbage collection until the worker's init() has run: setup's arguments import the worker
        # module (torch, transformers), init() DeepSpeed and the model, and Python's collector would walk the
        # ~500k objects those imports leave (almost none of them garbage) again and again. They are frozen
        # after init() (RankActor.call), so later collections skip them too; memory is unchanged.
        gc.disable()
        threads_as_ray_set()
        os.environ.update(env)
        redirect_output(log_name(role, rank))
        self.role, self.rank = role, rank
        self.workers: dict[str, Any] = {}
        self.cpu_threads: dict[str, int] = {}  # CPU: torch threads per role (orlhf/cpu/threads.py); absent: as Ray set
        self.guest_rng: dict[str, tuple] = {}  # a guest's RNG states while the host's are live
        self.turn, self.served = threading.Condition(), 0  # calls numbered by the driver run in that order
        # Every worker call runs on this one thread (see call()); Ray's pool threads only wait for their turn.
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"{role}-{rank}-compute")
        self.compute_free = threading.Lock()
        self.beside_locks: dict[str, threading.Lock] = {}  # call_beside: one at a time per guest

    def address(self) -> tuple[str, int]:
        """(ip, free port) of this rank's node: rank 0's becomes the group's rendezvous address."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, worker_cls: type, cfg: Any, env: dict[str, str], role: Optional[str] = None) -> None:
        role = role or self.role
        if role == self.role:
            os.environ.update(env)
        else:  # a guest has the same ranks: it joins the host's process group, rendezvous env untouched
            self.guest_rng[role] = rng_states()
        self.workers[role] = worker_cls(cfg)

    def call(self, role: str, method: str, ticket: Optional[int], *args, **kwargs) -> Any:
        """Run a worker method, in its turn, on the process's one compute thread (when no other call holds it).

        One thread, not Ray's pool threads (the actor has several, so that a guest's call can wait for its turn
        while the host's runs): each thread that runs torch code with more than one CPU thread gets an OpenMP
        team of its own, and libgomp, once it manages more threads than the process has cores, lets its idle
        team threads spin only ~100 rounds before sleeping on a futex, so they sleep and are woken around
        every op. Measured on the demo's sync step (2 cores, 2 threads, calls landing on 4 pool threads):
        train_step 0.75 s wall, 1.05 CPU-s, ~2,250 voluntary context switches; on one thread 0.43 s, 0.83
        CPU-s, ~200. It also keeps per-thread state (CUDA's current device, OpenMP's thread count) in one place.
        """
        with self.in_turn(ticket):
            if self.compute_free.acquire(blocking=False):
                try:
                    return self.compute.submit(self._run, role, method, args, kwargs).result()
                finally:
                    self.compute_free.release()
            # Another call holds the compute thread (calls overlap only when one is stuck or slow, e.g. in a
            # collective a failed peer left): this one runs here, as it would without a compute thread.
            return self._run(role, method, args, kwargs)

    def call_beside(self, role: str, method: str, *args, **kwargs) -> Any:
        """Run a guest's method at once, on this pool thread, beside whatever the compute thread runs: no turn,
        no RNG swap (ActorGroup.call_sharded_beside says when that is safe). Such calls of one guest still run
        one at a time; two guests' (async mode's reference scored ahead, a hosted critic) run side by side."""
        with self.beside_locks.setdefault(role, threading.Lock()):
            n = self.cpu_threads.get(role, 0)
            if n:
                apply_threads(n)
            return getattr(self.workers[role], method)(*args, **kwargs)

    def _run(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        n = self.cpu_threads.get(role, 0)
        if n:  # OpenMP's count is per thread: set on the thread that runs the work
            apply_threads(n)
        fn = getattr(self.workers[role], method)
        if role == self.role:
            try:
                return fn(*args, **kwargs)
            finally:
                if method == "init" and not gc.isenabled():  # start-up done: see __init__
                    gc.freeze()
                    gc.enable()
        host_rng = rng_states()
        set_rng_states(self.guest_rng[role])
        try:
            return fn(*args, **kwargs)
        finally:
            self.guest_rng[role] = rng_states()
            set_rng_states(host_rng)

    @contextmanager
    def in_turn(self, ticket: Optional[int]):
        """Wait for the calls numbered before `ticket` to finish (None: a process with one worker, no order)."""
        if ticket is None:
            yield
            return
        with self.turn:
            self.turn.wait_for(lambda: self.served == ticket)
        try:
            yield
        finally:
            with self.turn:
                self.served += 1
                self.turn.notify_all()

    def set_cpu_threads(self, n: int, role: Optional[str] = None) -> None:
        self.cpu_threads[role or self.role] = n

    def pid(self) -> int:
        return os.getpid()


class GroupCall:
    """Remote calls in flight on some members of a group (ranks or engines); .get() waits for all of them."""

    def __init__(
        self,
        role: str,
        method: str,
        refs: list,
        ranks: list,
        timeout_s: float,
        n_out: Optional[int] = None,
        host: Optional[str] = None,
    ):
        self.role, self.method, self.refs, self.ranks, self.n_out = role, method, refs, ranks, n_out
        self.timeout_s, self.host = timeout_s, host  # host: the role whose processes run a guest's calls

    def get(self, timeout_s: Optional[float] = None) -> list:
        """Results in member order; a failure or a timeout raises naming the role, method and member."""
        return wait_all(self.refs, self.ranks, self.role, self.method, timeout_s or self.timeout_s, self.host)

    def future(self):
        """A concurrent.futures.Future of a one-member call (asyncio code waits on it: rollout/executor.py)."""
        if len(self.refs) != 1:
            raise ValueError(f"{self.role}: future() needs a call on one member, this one has {len(self.refs)}")
        return self.refs[0].future()

    def get_cat(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Concatenate per-rank tensors along dim 0 and drop call_sharded's padding rows."""
        return torch.cat(self.get(timeout_s), dim=0)[: self.n_out]


def wait_all(refs: list, ranks: list, role: str, method: str, timeout_s: float, host: Optional[str] = None) -> list:
    """ray.get for refs from several ranks, failing fast on the first error and after timeout_s."""
    return _wait(refs, [(role, r, method, host) for r in ranks], f"{role}: {method}()", timeout_s)


def wait_calls(*calls: GroupCall, timeout_s: Optional[float] = None) -> list[list]:
    """Wait for several calls together, failing fast on the first error: when two groups talk to each other
    (a weight sync), one side's failure leaves the other stuck in a collective, so neither is waited alone.
    Returns each call's results."""
    refs = [r for c in calls for r in c.refs]
    where = [(c.role, k, c.method, c.host) for c in calls for k in c.ranks]
    what = " + ".join(f"{c.role}: {c.method}()" for c in calls)
    flat = _wait(refs, where, what, timeout_s or max(c.timeout_s for c in calls))
    out, i = [], 0
    for c in calls:
        out.append(flat[i : i + len(c.refs)])
        i += len(c.refs)
    return out


def _wait(refs: list, where: list[tuple[str, Any, str, Optional[str]]], what: str, timeout_s: float) -> list:
    """where[i] = (role, rank, method, host or None) of refs[i], for the error of the first one that fails or
    times out."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            several = len({w[0] for w in where}) > 1  # name the group of each rank when there are several
            still = sorted(
                (f"{where[index[r]][0]} {where[index[r]][1]}" if several else where[index[r]][1] for r in pending),
                key=str,
            )
            raise TimeoutError(
                f"{what} did not finish on rank(s) {still} within {timeout_s:.0f} s "
                "(raise --ray_timeout_s if the work is just slow)"
            )
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        for ref in done:
            i = index[ref]
            role, rank, method, host = where[i]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                raise RankError(role, rank, method, str(e), host=host) from None
            except ray.exceptions.RayActorError as e:
                raise RankError(role, rank, method, f"the rank actor died: {e}", died=True, host=host) from None
    return results


class ActorGroup:
    """N rank actors of one role (actor, critic, ref, reward) running `worker_cls(cfg)` each; or, made by
    host(), a guest role's workers inside another group's rank actors (`host` names that group's role)."""

    def __init__(
        self,
        role: str,
        worker_cls: type,
        cfg: Any,
        slots: Sequence[RankBundle],
        *,
        device: str,
        gpus_per_node: int = 1,
        timeout_s: float = 600.0,
        env: Optional[dict[str, str]] = None,
        guests: Sequence[str] = (),
    ):
        self.role, self.world_size, self.timeout_s, self.worker_cls = role, len(slots), timeout_s, worker_cls
        self.guests, self.host_role, self.turns, self.beside = tuple(guests), None, None, False
        check_exports(role, worker_cls)  # before any process starts
        base_env = {"DS_ACCELERATOR": device, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if LOG_DIR_ENV in os.environ:  # ranks write their output to <save_path>/logs (storage/logs.py)
            base_env.setdefault(LOG_DIR_ENV, os.environ[LOG_DIR_ENV])
        self.actors = [self._spawn(rank, slot, device, base_env) for rank, slot in enumerate(slots)]
        # Rendezvous on rank 0's node. On CUDA each rank sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES),
        # so LOCAL_RANK is 0 there; on CPU it is the rank's index within its node group.
        master_addr, master_port = wait_all([self.actors[0].address.remote()], [0], role, "address", timeout_s)[0]
        setups = []
        for rank, actor in enumerate(self.actors):
            rank_env = {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0" if device == "cuda" else str(rank % max(gpus_per_node, 1)),
            }
            setups.append(actor.setup.remote(worker_cls, cfg, rank_env))
        wait_all(setups, list(range(self.world_size)), role, "setup", timeout_s)
        log.info("%s: %d rank(s), pids %s", role, self.world_size, self.pids())

    def _spawn(self, rank: int, slot: RankBundle, device: str, env: dict[str, str]):
        if slot.placement_group is not None:
            opts = scheduling_options(slot, device)
        else:  # no placement group (tests, ad-hoc use): Ray picks a node
            opts = {"num_cpus": slot.share, "num_gpus": slot.share if device == "cuda" else 0}
        # A guest's calls wait for their turn on a pool thread (module docstring): room for two more per guest.
        concurrency = 2 + 2 * len(self.guests)
        return RankActor.options(**opts, max_restarts=0, max_concurrency=concurrency).remote(self.role, rank, env)

    def host(self, role: str, worker_cls: type, cfg: Any, beside: bool = False) -> "ActorGroup":
        """`role`'s workers in this group's rank processes, rank k's in rank k's process, as a group of its own
        (same calls; errors name `role` and the host). Needs `role` among the guests this group was built for.
        From here on every call to these processes is numbered (module docstring). `beside` (roles.runs_beside:
        the critic in a one-rank actor's process): its call_sharded_beside calls run beside the host's, so the
        processes' thread shares count it as a process of its own (`processes`)."""
        if role not in self.guests:
            raise ValueError(f"{self.role}: built without room for guest {role!r} (guests={self.guests})")
        check_exports(role, worker_cls)
        if self.turns is None:
            self.turns = Turns(self.world_size)
        view = object.__new__(ActorGroup)
        view.role, view.world_size, view.timeout_s, view.worker_cls = role, self.world_size, self.timeout_s, worker_cls
        view.guests, view.host_role, view.turns, view.actors = (), self.role, self.turns, self.actors
        view.beside = beside
        ranks = list(range(self.world_size))
        wait_all(
            [a.setup.remote(worker_cls, cfg, {}, role) for a in self.actors],
            ranks,
            role,
            "setup",
            self.timeout_s,
            self.role,
        )
        return view

    # ---- calls (method references, orlhf/distributed/endpoints.py) --------------------------------------------------
    def _submit(self, name: str, ranks: list[int], args: list[tuple], kwargs: dict) -> GroupCall:
        """Start `name` on `ranks` (args[i] for ranks[i]); numbered for all of them at once when hosting."""
        if self.turns is None:
            refs = [self.actors[r].call.remote(self.role, name, None, *a, **kwargs) for r, a in zip(ranks, args)]
        else:
            with self.turns.lock:
                refs = [
                    self.actors[r].call.remote(self.role, name, self.turns.take(r), *a, **kwargs)
                    for r, a in zip(ranks, args)
                ]
        return GroupCall(self.role, name, refs, ranks, self.timeout_s, host=self.host_role)

    def call(self, fn: Callable, *args, **kwargs) -> GroupCall:
        """Call `fn` on every rank with the same arguments; .get() gives the results in rank order."""
        name = method_name(self.role, self.worker_cls, fn)
        return self._submit(name, list(range(self.world_size)), [args] * self.world_size, kwargs)

    def call_rank(self, rank: int, fn: Callable, *args, **kwargs) -> GroupCall:
        return self._submit(method_name(self.role, self.worker_cls, fn), [rank], [args], kwargs)

    def call_sharded_beside(self, fn: Callable, batch: Any, *args) -> GroupCall:
        """call_sharded for a call that may run beside its host's call in flight instead of after it: a guest
        of a one-rank host (on CPU, the reference or the critic inside the actor's process). Only there, and only
        for a call that draws no random numbers: a frozen model's forward (reference, reward model), or the
        hosted critic's values and train steps (roles.host_of hosts only a critic without dropout). A single rank
        has no peer whose calls could interleave differently (its one-rank collectives have nobody to wait for),
        and skipping the RNG swap of what draws nothing leaves the host's random numbers as they were. It runs on
        a pool thread of the host's process (RankActor.call_beside), unnumbered. Any other group: call_sharded."""
        if self.host_role is None or self.world_size != 1:
            return self.call_sharded(fn, batch, *args)
        name = method_name(self.role, self.worker_cls, fn)
        out = GroupCall(
            self.role,
            name,
            [self.actors[0].call_beside.remote(self.role, name, batch, *args)],
            [0],
            self.timeout_s,
            host=self.host_role,
        )
        out.n_out = len(batch)
        return out

    def call_sharded(self, fn: Callable, batch: Any, *args, **kwargs) -> GroupCall:
        """Split `batch` (a types.py dataclass with .split, or a list) over the ranks in contiguous chunks;
        .get_cat() gives per-rank tensors concatenated in batch order, .get() the per-rank results."""
        name = method_name(self.role, self.worker_cls, fn)
        chunks = shard(batch, self.world_size)
        out = self._submit(name, list(range(self.world_size)), [(c, *args) for c in chunks], kwargs)
        out.n_out = len(batch)
        return out

    def set_cpu_threads(self, n: int) -> None:
        """Every rank runs this group's next calls with n torch threads (CPU, per phase: orlhf/cpu/threads.py)."""
        wait_all(
            [a.set_cpu_threads.remote(n, self.role) for a in self.actors],
            list(range(self.world_size)),
            self.role,
            "set_cpu_threads",
            self.timeout_s,
            self.host_role,
        )

    def pids(self) -> list[int]:
        return wait_all(
            [a.pid.remote() for a in self.actors],
            list(range(self.world_size)),
            self.role,
            "pid",
            self.timeout_s,
            self.host_role,
        )

    @property
    def processes(self) -> list:
        """One key per rank process (a guest's are its host's, unless its calls run beside the host's: then one
        of its own, as it works beside them): cpu/threads.py counts the distinct ones."""
        return [(id(a), self.role) if self.beside else id(a) for a in self.actors]

    def shutdown(self) -> None:
        """Kill the rank actors; a guest only lets go of them (its host's shutdown kills them)."""
        if self.host_role is None:
            for a in self.actors:
                ray.kill(a, no_restart=True)
        self.actors = []


class Turns:
    """The driver's per-rank call counters for processes that host several workers (RankActor.in_turn)."""

    def __init__(self, world_size: int):
        self.lock = threading.Lock()  # held while one group call numbers all its ranks
        self.next = [0] * world_size

    def take(self, rank: int) -> int:
        n = self.next[rank]
        self.next[rank] += 1
        return n


def shard(batch: Any, world_size: int) -> list:
    """Contiguous, equal-size chunks; the batch is padded by repeating its last row to a multiple of world_size."""
    n = len(batch)
    if n == 0:
        raise ValueError("cannot shard an empty batch")
    per = -(-n // world_size)
    pad = per * world_size - n
    if isinstance(batch, list):
        padded = batch + [batch[-1]] * pad
        return [padded[i * per : (i + 1) * per] for i in range(world_size)]
    if pad:
        batch = type(batch).cat([batch] + [batch.split([n - 1, 1])[1]] * pad)
    return batch.split([per] * world_size)
