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

`pending` (optional): batches a checkpoint kept (pending()), used for the loader's first batches instead of
generating them again: a resumed run trains what the stopped one had generated, with the weights it had.

Invariants:
- At most `queue_size` batches are generated and not yet taken by the trainer (queue_size slots, one taken per batch
  and given back when the controller takes it); so rollouts are at most queue_size versions stale (with
  --partial_rollout: their oldest tokens).
- A weight sync holds the gate's lock, which the producer holds while generating: weights never change within an
  engine call (with --partial_rollout they may change between two segments of a batch).
- A sync starts once the producer is generating or cannot (SyncGate.settle -> settled()): a batch given a slot
  before the sync is generated with the weights before it. Which weights generate which batch is then fixed by the
  order of the calls, not by which thread wins the lock, so an async run repeats itself (without --partial_rollout,
  whose syncs land between segments as they come) and a resume from pending() trains the batches an uninterrupted
  run would.
- pending() waits until no generation is in flight: the queue then holds every batch generated and not trained.
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
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from orlhf.types import Rollout

_DONE = object()
STOP_WAIT_S = 5.0  # how long context exit waits for the producer thread
log = logging.getLogger(__name__)


@dataclass
class GeneratedBatch:
    """One step's batch as the producer hands it from its thread to the controller's (queue items, next())."""

    prompts: list  # the step's prompts (B)
    rollouts: list[Rollout]  # B x n_samples_per_prompt, prompt-major
    seconds: float = 0.0  # generation time, syncs let through excluded (a grouped generation: this batch's share)
    ahead: Any = None  # `ahead`'s result (the controller's: scoring.ScoredAhead, the frozen models' calls), or None
    filled: Any = None  # --dynamic_filtering: the filter's full batch (dynamic_filtering.FilledBatch), or None


@dataclass(frozen=True)
class KeptBatch:
    """A batch generated ahead and not yet trained, as a checkpoint keeps it (pending(); trainer/run_state.py)."""

    rollouts: list[Rollout]  # B x n_samples_per_prompt, prompt-major; its prompts are the loader's next batch
    seconds: float  # its generation time


class SyncGate:
    """The lock shared by generation (the producer) and weight syncs (the controller), and a sync's request to
    take it between two segments of a generation (--partial_rollout)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting = 0  # syncs asking for the lock
        self.settle: Callable[[], None] = lambda: None  # waited for before a sync (the producer's settled())
        self.yielded_s = 0.0  # seconds the producer spent letting syncs run (not generation time)
        self.yields = 0

    @contextmanager
    def sync(self) -> Iterator[None]:
        """The controller's side: hold the lock for a weight sync; a generator between segments lets go of it."""
        self.settle()
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

    @property
    def waiting(self) -> bool:
        """A sync is asking for the lock (agents' turns hold off new engine calls until it ran: partial.TurnGate)."""
        with self._cond:
            return self._waiting > 0

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
        pending: tuple[KeptBatch, ...] = (),
    ):
        self.generate, self.loader, self.ahead, self.fill = generate, loader, ahead, fill
        self.per_generation = batches_per_generation  # --vllm_generate_batch_size / --rollout_batch_size
        self.gate = SyncGate()
        self.gate.settle = self.settled
        self.lock = self.gate.lock  # held while generating and while syncing weights
        self._pending = list(pending)  # the loader's next batches, from a checkpoint
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orlhf-rollout-producer", daemon=True)
        self._first_index = getattr(loader, "steps_done", 0)
        # The producer's state, under _cv: free slots; a batch taken and not yet queued; the generation lock held;
        # the thread ended.
        self._cv = threading.Condition()
        self._free, self._working, self._in_lock, self._ended = queue_size, False, False, False

    def __enter__(self) -> "RolloutProducer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()  # unblock a producer waiting for a slot
        self._thread.join(timeout=STOP_WAIT_S)
        if self._thread.is_alive():
            log.info(
                "rollout producer still in a generation after %.0f s; leaving it to end with the engines", STOP_WAIT_S
            )

    def __iter__(self) -> Iterator[GeneratedBatch]:
        """Every batch, in loader order."""
        while True:
            item = self.next()
            if item is None:
                return
            yield item

    def next(self) -> Optional[GeneratedBatch]:
        """The next batch, None after the last."""
        item = self._queue.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        with self._cv:  # the trainer has it: the producer may start one more
            self._free += 1
            self._cv.notify_all()
        return item

    # ---- the producer's state, for syncs and checkpoints --------------------------------------------------------
    def _quiet(self) -> bool:
        """No generation in flight, and none can start before the trainer takes a batch."""
        return self._ended or (not self._working and self._free < self._needs())

    def _needs(self) -> int:
        """Slots the next batch takes: one, or one per batch of a generation (a kept batch is queued alone)."""
        return 1 if self._pending else self.per_generation

    def settled(self) -> None:
        """Wait until the producer generates (holds the lock) or cannot (no slot, or ended): a sync then never takes
        the lock before a batch that had its slot first."""
        with self._cv:
            self._cv.wait_for(lambda: self._in_lock or self._quiet())

    def pending(self) -> tuple[list[KeptBatch], int]:
        """Once no generation is in flight: the batches generated and not yet taken, in order, and how many filled
        batches (--dynamic_filtering) were left out: those cannot be rebuilt from the loader's position."""
        with self._cv:
            self._cv.wait_for(self._quiet)
            items = [item for item in list(self._queue.queue) if isinstance(item, GeneratedBatch)]
        kept = [KeptBatch(item.rollouts, item.seconds) for item in items if item.filled is None]
        return kept, len(items) - len(kept)

    def _take(self, n: int) -> bool:
        """Wait for `n` free slots and take them; False when stopping."""
        with self._cv:
            self._cv.wait_for(lambda: self._free >= n or self._stop.is_set())
            if self._stop.is_set():
                return False
            self._free -= n
            self._working = True
            return True

    def _set(self, **state) -> None:
        with self._cv:
            for name, value in state.items():
                setattr(self, f"_{name}", value)
            self._cv.notify_all()

    @contextmanager
    def _generating(self) -> Iterator[None]:
        with self.lock:
            self._set(in_lock=True)
            try:
                yield
            finally:
                self._set(in_lock=False)

    # ---- the thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.per_generation > 1:
                self._run_grouped()
                return
            for i, batch in enumerate(self._batches(), start=self._first_index):
                if not self._take(1):
                    return
                if self._pending and self.fill is None:  # generated before a checkpoint: trained as it was
                    kept = self._pending.pop(0)
                    item: Optional[GeneratedBatch] = GeneratedBatch(batch, kept.rollouts, kept.seconds)
                else:
                    with self._generating():
                        t0, yielded = time.perf_counter(), self.gate.yielded_s
                        item = self._make(batch, i)
                        seconds = time.perf_counter() - t0 - (self.gate.yielded_s - yielded)  # syncs let through
                    if item is not None:
                        item.seconds = seconds
                if self._stop.is_set() or item is None:
                    break
                item.ahead = self.ahead(item.prompts, item.rollouts) if self.ahead is not None else None
                self._queue.put(item)
                self._set(working=False)
            self._queue.put(_DONE)
        except BaseException as e:  # surfaced in the controller's thread
            self._queue.put(e)
        finally:
            self._set(ended=True, working=False)

    def _run_grouped(self) -> None:
        """--vllm_generate_batch_size: several loader batches generated in one call (one weight version, the first
        batch's sampling seed), then queued one by one; each takes a slot, so the queue must hold them all. Batches
        a checkpoint kept are queued first, one by one."""
        loader = iter(self.loader)
        index = self._first_index
        while True:
            group = [b for _, b in zip(range(self._needs()), loader)]
            if not group:
                break
            if not self._take(len(group)):
                return
            if self._pending:
                parts = [self._pending.pop(0)]
            else:
                with self._generating():
                    t0, yielded = time.perf_counter(), self.gate.yielded_s
                    rollouts = self.generate([p for b in group for p in b], index)
                    seconds = time.perf_counter() - t0 - (self.gate.yielded_s - yielded)
                split = split_rollouts(rollouts, [len(b) for b in group])
                parts = [KeptBatch(part, seconds / len(group)) for part in split]
            if self._stop.is_set():
                return
            for prompts, part in zip(group, parts):
                early = self.ahead(prompts, part.rollouts) if self.ahead is not None else None
                self._queue.put(GeneratedBatch(prompts, part.rollouts, part.seconds, early))
            self._set(working=False)
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

    def _make(self, batch, i: int) -> Optional[GeneratedBatch]:
        """Step i's batch (its seconds and `ahead` set by the caller); None when the filter ran out."""
        if self.fill is None:
            return GeneratedBatch(batch, self.generate(batch, i))
        filled = self.fill(batch, i)
        if filled is None:
            return None
        return GeneratedBatch(filled.prompts, filled.rollouts, filled=filled)
