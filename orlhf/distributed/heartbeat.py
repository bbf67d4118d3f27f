"""Health pings of the processes behind calls in flight: a process that stops answering them is hung.

    a wait on rank or engine calls (distributed/groups.py _wait, settle)
      every PING_EVERY_S while a call runs: pid() to each process it still runs on, in the actor's HEALTH
        concurrency group, so the ping runs beside any call (a long train step, a collective waiting for a peer, a
        call waiting its turn) and answers at once while the process lives
      a ping unanswered for hang_s (--hang_timeout_s): the process is stopped, swapped out or deadlocked holding the
        GIL; the wait raises RankError(hung=True) naming it, and the run counts it lost: an engine is replaced
        (trainer/engine_restart.py), a rank restarts the run's groups (launch/restart.py); both kill it first
A process that answers but whose call never ends (a collective stuck in native code) is the deadline's
(--ray_timeout_s): a live process may be slow, and a restart would only repeat it.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import ray

HEALTH = "health"  # the concurrency group of every rank and engine actor's pid()
HEALTH_GROUPS = {HEALTH: 1}  # ray.remote(concurrency_groups=...) of those actors
PING_EVERY_S = 5.0


class Heartbeat:
    """Pings `handles[i]` (an actor with a HEALTH-group pid(), or None: not checked) while member i's call runs.
    The first ping goes out PING_EVERY_S after the start, so short calls send none."""

    def __init__(self, handles: Sequence, hang_s: float, every_s: float = PING_EVERY_S):
        self.handles, self.hang_s, self.every_s = list(handles), hang_s, min(every_s, hang_s / 2)
        start = time.monotonic()
        self.answered = {i: start for i in range(len(self.handles))}  # last answer (or the start)
        self.out: dict[int, tuple] = {}  # member -> (ping in flight, sent at)

    def hung(self, members) -> Optional[tuple[int, float]]:
        """(member, seconds without an answer) of the first of `members` (indices into handles) whose ping is
        unanswered for hang_s; None when all answer. Sends the pings that are due. A ping that failed (the process
        died) counts as answered: the call's own result reports the death."""
        now = time.monotonic()
        for i in members:
            handle = self.handles[i]
            if handle is None:
                continue
            if i in self.out:
                ref, sent = self.out[i]
                if ray.wait([ref], timeout=0, fetch_local=False)[0]:
                    del self.out[i]
                    self.answered[i] = now
                elif now - sent >= self.hang_s:
                    return i, now - sent
            if i not in self.out and now - self.answered.get(i, -math.inf) >= self.every_s:
                self.out[i] = (handle.pid.remote(), now)
        return None


def on_one_thread(cls: type, keep: Sequence[str] = ("pid",)) -> type:
    """A subclass of `cls` (same name) whose constructor and exported methods (distributed/endpoints.py) all run on
    one thread of its own, for an actor whose work keeps per-thread state from its start: vLLM's CPU engine (its
    OpenMP thread count and core binding). As a Ray actor with HEALTH_GROUPS its calls run on Ray's pool threads,
    which hand each call to that thread and wait; `keep` (its HEALTH-group pid()) runs where Ray runs it, so it
    answers while a call runs."""
    from orlhf.distributed.endpoints import exports

    prefix = f"orlhf-{cls.__name__}"

    def __init__(self, *args, **kwargs):
        self._own_thread = ThreadPoolExecutor(1, thread_name_prefix=prefix)
        self._own_thread.submit(cls.__init__, self, *args, **kwargs).result()

    def on_thread(fn: Callable) -> Callable:
        @functools.wraps(fn)  # the signature Ray reads, the endpoint mark
        def run(self, *args, **kwargs):
            if threading.current_thread().name.startswith(prefix):  # one method calling another
                return fn(self, *args, **kwargs)
            return self._own_thread.submit(fn, self, *args, **kwargs).result()

        return run

    body = {name: on_thread(fn) for name, fn in exports(cls).items() if name not in keep}
    return type(cls.__name__, (cls,), {**body, "__init__": __init__, "__doc__": cls.__doc__})
