"""The producer side of --async_train: a thread that keeps the engines generating ahead of the trainers.

    producer thread:  [acquire a slot] -> lock -> engines.generate(batch i) -> unlock -> ahead(batch i)
                      -> queue.put(batch i)
    controller:       queue.get() -> release a slot -> score, train -> sync (takes the lock)

`fill` (optional, --dynamic_filtering): builds each step's batch instead of one generation
(trainer/dynamic_filtering.py: generate, score, keep the prompts whose samples disagree, refill), under the lock,
so queued batches are full ones.
`batches_per_generation` (--vllm_generate_batch_size / --rollout_batch_size): that many loader batches generated in
one engine call (over-sampling ahead into the queue, as OpenRLHF), then queued one by one.
`ahead` (optional): called with each batch's prompts and rollouts as soon as it is generated, outside the lock;
what it returns travels with the batch. The controller starts the frozen models' forwards there (reference,
reward model: Scorer.ahead, orlhf/trainer/scoring.py), so they run while the trainers still work on the batch before.

`gate` (SyncGate): the lock a generation and a weight sync share. With --partial_rollout the engines generate in
segments (rollout/partial.py), and between two segments the producer lets a waiting sync take the lock
(SyncGate.yield_to_sync): a sync then waits for one segment, not for the longest response of the batch.

Invariants:
- At most `queue_size` batches are generated and not yet taken by the trainer (a semaphore of queue_size
  slots, released when the controller takes a batch); so rollouts are at most queue_size versions stale (with
  --partial_rollout: their oldest tokens).
- A weight sync holds the gate's lock, which the producer holds while generating: weights never change within an
  engine call (with --partial_rollout they may change between two segments of a batch).
- An exception in the producer is re-raised in the controller's thread at the next get; stopping the
  producer (context exit: the end, an error or Ctrl-C) returns within STOP_WAIT_S. A generation in flight
  cannot be interrupted from here: the thread (a daemon) is left to end when the engines are shut down, which
  the caller does right after, and its result is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

_DONE = object()
STOP_WAIT_S = 5.0  # how long context exit waits for the producer thread
log = logging.getLogger(__name__)


class SyncGate:
    """The lock shared by generation (the producer) and weight syncs (the controller), and a sync's request to
    take it between two segments of a generation (--partial_rollout)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting = 0  # syncs asking for the lock
        self.yielded_s = 0.0  # seconds the producer spent letting syncs run (not generation time)
        self.yields = 0

    @contextmanager
    def sync(self) -> Iterator[None]:
        """The controller's side: hold the lock for a weight sync; a generator between segments lets go of it."""
        with self._cond:
            self._waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def yield_to_sync(self) -> bool:
        """The producer's side, holding the lock between two segments: when a sync is waiting, let it run, then
        take the lock back. Returns whether a sync ran."""
        with self._cond:
            if not self._waiting:
                return False
        t0 = time.perf_counter()
        self.lock.release()
        try:
            with self._cond:  # the sync has the lock once it stops waiting
                self._cond.wait_for(lambda: self._waiting == 0)
        finally:
            self.lock.acquire()  # after the sync
        self.yielded_s += time.perf_counter() - t0
        self.yields += 1
        return True


def split_rollouts(rollouts: list, sizes: list[int]) -> list[list]:
    """Rollouts of several prompt batches generated together (prompt-major, prompt_index into the joined prompts)
    -> one list per batch, prompt_index counted within it."""
    import dataclasses

    out, start = [], 0
    for n in sizes:
        part = [r for r in rollouts if start <= r.prompt_index < start + n]
        out.append([dataclasses.replace(r, prompt_index=r.prompt_index - start) for r in part])
        start += n
    return out


class RolloutProducer:
    def __init__(
        self,
        generate: Callable[[list, int], list],
        loader,
        queue_size: int,
        ahead: Optional[Callable[[list, list], Any]] = None,
        fill: Optional[Callable[[Iterator[list], int], Any]] = None,
        batches_per_generation: int = 1,
    ):
        self.generate, self.loader, self.ahead, self.fill = generate, loader, ahead, fill
        self.per_generation = batches_per_generation  # --vllm_generate_batch_size / --rollout_batch_size
        self.gate = SyncGate()
        self.lock = self.gate.lock  # held while generating and while syncing weights
        self._slots = threading.Semaphore(queue_size)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orlhf-rollout-producer", daemon=True)
        self._first_index = getattr(loader, "steps_done", 0)

    def __enter__(self) -> "RolloutProducer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._slots.release()  # unblock a producer waiting for a slot
        self._thread.join(timeout=STOP_WAIT_S)
        if self._thread.is_alive():
            log.info(
                "rollout producer still in a generation after %.0f s; leaving it to end with the engines", STOP_WAIT_S
            )

    def __iter__(self) -> Iterator[tuple[list, list, float, Any, Any]]:
        """(prompts, rollouts, generation seconds, ahead's result or None, the filled batch or None) per batch, in
        loader order."""
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            self._slots.release()  # the trainer has it: the producer may start one more
            yield item

    def _run(self) -> None:
        try:
            if self.per_generation > 1:
                self._run_grouped()
                return
            for i, batch in enumerate(self._batches(), start=self._first_index):
                self._slots.acquire()
                if self._stop.is_set():
                    return
                with self.lock:
                    t0, yielded = time.perf_counter(), self.gate.yielded_s
                    prompts, rollouts, filled = self._make(batch, i)
                    seconds = time.perf_counter() - t0 - (self.gate.yielded_s - yielded)  # syncs let through: not ours
                if self._stop.is_set() or prompts is None:
                    break
                early = self.ahead(prompts, rollouts) if self.ahead is not None else None
                self._queue.put((prompts, rollouts, seconds, early, filled))
            self._queue.put(_DONE)
        except BaseException as e:  # surfaced in the controller's thread
            self._queue.put(e)

    def _run_grouped(self) -> None:
        """--vllm_generate_batch_size: several loader batches generated in one call (one weight version, the first
        batch's sampling seed), then queued one by one; each takes a slot, so the queue must hold them all."""
        loader = iter(self.loader)
        index = self._first_index
        while True:
            group = [b for _, b in zip(range(self.per_generation), loader)]
            if not group:
                break
            for _ in group:
                self._slots.acquire()
            if self._stop.is_set():
                return
            with self.lock:
                t0, yielded = time.perf_counter(), self.gate.yielded_s
                rollouts = self.generate([p for b in group for p in b], index)
                seconds = time.perf_counter() - t0 - (self.gate.yielded_s - yielded)
            if self._stop.is_set():
                return
            for prompts, part in zip(group, split_rollouts(rollouts, [len(b) for b in group])):
                early = self.ahead(prompts, part) if self.ahead is not None else None
                self._queue.put((prompts, part, seconds / len(group), early, None))
            index += len(group)
        self._queue.put(_DONE)

    def _batches(self) -> Iterator:
        """The loader's prompt batches; with `fill` (--dynamic_filtering), one shared iterator per step, from which
        the filter reads as many batches as that step needs."""
        if self.fill is None:
            yield from self.loader
            return
        source = iter(self.loader)
        while True:
            yield source

    def _make(self, batch, i: int) -> tuple:
        """(prompts, rollouts, filled batch or None) for step i; (None, None, None) when the filter ran out."""
        if self.fill is None:
            return batch, self.generate(batch, i), None
        filled = self.fill(batch, i)
        if filled is None:
            return None, None, None
        return filled.prompts, filled.rollouts, filled
