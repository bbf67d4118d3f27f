"""The rank actor of CPU runs: one process per rank that may hold several roles' workers (cpu/hosting.py drives it).

    CpuRankActor(role, rank, env)        the host role's rank process (distributed/groups.RankActor's remote API)
      .setup(worker_cls, cfg, env)       the host role's worker
      .setup_guest(role, worker_cls, cfg)  a guest role's worker in this process, on RNG states of its own
      .call_as(role, method, ticket, ..)   a worker's method, in the driver's turn order, on the compute thread
      .call_beside(role, method, ..)       a guest's method at once, on this pool thread (no turn, no RNG swap)
      .set_cpu_threads(n, role)          torch threads for that role's later calls (cpu/threads.py)

Invariants (cpu/hosting.py's module docstring says why):
- Numbered calls run one at a time, in ticket order; a failed call still passes the turn on.
- A guest's numbered calls run on its own RNG states, swapped in and out: the host's random numbers are those it
  would draw alone in its process.
- Every call runs on one compute thread while it is free, with its role's torch thread count applied on that
  thread (OpenMP's count is per thread).
- No automatic garbage collection until the host's init() has run; the heap is frozen then.
- Freed memory stays in glibc's heap for the next allocation, in this call or a later one (cpu/memory.py).
"""

from __future__ import annotations

import gc
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Optional

import ray
import torch

from orlhf.cpu.ds_import import load_deepspeed
from orlhf.cpu.memory import keep_freed_memory
from orlhf.cpu.threads import apply_threads, threads_as_ray_set
from orlhf.distributed import addresses
from orlhf.distributed.heartbeat import HEALTH, HEALTH_GROUPS
from orlhf.distributed.rank_actor import log_name
from orlhf.storage.import_tables import install as install_import_tables
from orlhf.storage.logs import redirect_output


def tune_rank_process() -> None:
    """What a CPU rank process does before its worker's init(), for code that runs workers in a process of its own
    making (benchmarks, the multi-process worker tests): freed memory kept in the heap, DeepSpeed's Muon module
    loaded uncompiled."""
    keep_freed_memory()
    load_deepspeed()


def rng_states() -> tuple:
    """The process's global RNG states a worker draws from."""
    import numpy as np

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_rng_states(states: tuple) -> None:
    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class CpuRankActor:
    """Holds this rank's workers keyed by role: its own (`role`) and guests; runs their methods by name in the
    driver's order. No logic of its own beyond the invariants of the module docstring."""

    def __init__(self, role: str, rank: int, env: dict[str, str]):
        # No automatic garbage collection until the worker's init() has run: setup's arguments import the worker
        # module (torch, transformers), init() DeepSpeed and the model, and Python's collector would walk the
        # objects those imports leave (almost none of them garbage) again and again. They are frozen after init()
        # (_run), so later collections skip them too; memory is unchanged.
        gc.disable()
        install_import_tables()  # a worker that did not preload transformers (storage/import_tables.py)
        threads_as_ray_set()
        keep_freed_memory()  # before the worker allocates: its large blocks then come back from the heap
        os.environ.update(env)
        redirect_output(log_name(role, rank))
        addresses.pin()  # before DeepSpeed starts: it reads the interface this exports
        self.role, self.rank = role, rank
        self.workers: dict[str, Any] = {}
        self.cpu_threads: dict[str, int] = {}  # torch threads per role (cpu/threads.py); absent: as Ray set
        self.guest_rng: dict[str, tuple] = {}  # a guest's RNG states while the host's are live
        self.turn, self.served = threading.Condition(), 0  # calls numbered by the driver run in that order
        # Every worker call runs on this one thread (see call_as); Ray's pool threads only wait for their turn.
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"{role}-{rank}-compute")
        self.compute_free = threading.Lock()
        self.beside_locks: dict[str, threading.Lock] = {}  # call_beside: one at a time per guest

    def address(self) -> tuple[str, int]:
        """(ip, free port) this rank's peers reach it at (distributed/addresses.py): rank 0's becomes the group's
        rendezvous address."""
        return addresses.local_address(), addresses.free_port()

    def setup(self, worker_cls: type, cfg: Any, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.workers[self.role] = worker_cls(cfg)

    def setup_guest(self, role: str, worker_cls: type, cfg: Any) -> None:
        """A guest has the same ranks: it joins the host's process group, rendezvous env untouched."""
        self.guest_rng[role] = rng_states()
        self.workers[role] = worker_cls(cfg)

    def call(self, method: str, *args, **kwargs) -> Any:
        """The host role's method, unnumbered (a process without guests)."""
        return self.call_as(self.role, method, None, *args, **kwargs)

    def call_as(self, role: str, method: str, ticket: Optional[int], *args, **kwargs) -> Any:
        """Run `role`'s worker method, in its turn, on the process's one compute thread (when no other call holds
        it). One thread, not Ray's pool threads (the actor has several, so that a guest's call can wait for its
        turn while the host's runs): each thread that runs torch code with more than one CPU thread gets an
        OpenMP team of its own, and once libgomp manages more threads than the process has cores its idle team
        threads sleep on a futex and are woken around every op (cpu/threads.py). It also keeps per-thread state
        (OpenMP's thread count) in one place."""
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
        no RNG swap (cpu/hosting.py says when that is safe). Such calls of one guest still run one at a time;
        two guests' (async mode's reference scored ahead, a hosted critic) run side by side."""
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
            if method == "init":
                load_deepspeed()  # before the worker's init() reaches deepspeed.initialize (cpu/ds_import.py)
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

    @ray.method(concurrency_group=HEALTH)
    def pid(self) -> int:
        """Also the health check (distributed/heartbeat.py): its own thread, beside every call and turn."""
        return os.getpid()
