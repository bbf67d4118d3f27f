"""RolloutProducer (the --async_train producer): staleness bound, version bookkeeping, no sync mid-generation."""

import threading
import time
from dataclasses import dataclass

import pytest

from orlhf.trainer.async_producer import RolloutProducer


@dataclass
class FakeRollout:
    weight_version: int


class FakeTrainer:
    """Plays the controller: takes batches, 'trains', then syncs under the producer's lock (version += 1)."""

    def __init__(self):
        self.version = 0
        self.generating = False
        self.overlaps = 0  # syncs that started while a generation was in flight (must stay 0)

    def generate(self, prompts, index):
        self.generating = True
        time.sleep(0.01)
        out = [FakeRollout(self.version)]
        self.generating = False
        return out

    def run(self, queue_size, batches=12, train_s=0.02):
        staleness = []
        producer = RolloutProducer(self.generate, [[i] for i in range(batches)], queue_size)
        seen = []
        with producer:
            for item in producer:
                seen.append(item.prompts[0])
                time.sleep(train_s)  # training overlaps the next generation
                staleness.append(self.version - item.rollouts[0].weight_version)
                with producer.lock:
                    self.overlaps += self.generating
                    self.version += 1
        return seen, staleness


@pytest.mark.parametrize("queue_size", [1, 2, 3])
def test_staleness_never_exceeds_queue_size(queue_size):
    trainer = FakeTrainer()
    seen, staleness = trainer.run(queue_size)
    assert seen == list(range(12))  # every batch once, in order
    assert max(staleness) <= queue_size, staleness
    assert max(staleness) >= 1  # generation really ran ahead of training
    assert trainer.overlaps == 0


def test_producer_error_reaches_the_trainer():
    def boom(prompts, index):
        raise RuntimeError("engine 0 died")

    with pytest.raises(RuntimeError, match="engine 0 died"):
        with RolloutProducer(boom, [[0], [1]], 1) as producer:
            for _ in producer:
                pass


def test_stopping_early_does_not_hang():
    trainer = FakeTrainer()
    producer = RolloutProducer(trainer.generate, [[i] for i in range(100)], 2)
    t0 = time.monotonic()
    with producer:
        for i, _ in enumerate(producer):
            if i == 2:
                break
    assert time.monotonic() - t0 < 10
    assert not any(t.name == "orlhf-rollout-producer" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("error", [RuntimeError("trainer rank 1 died"), KeyboardInterrupt()])
def test_an_error_or_ctrl_c_mid_generation_stops_within_seconds(error, monkeypatch):
    """The trainer fails (or the user presses Ctrl-C) while the producer is inside a generation that would take
    10 minutes: leaving the producer returns within STOP_WAIT_S, not after the generation."""
    import orlhf.trainer.async_producer

    assert orlhf.trainer.async_producer.STOP_WAIT_S <= 10  # seconds, as promised
    monkeypatch.setattr(orlhf.trainer.async_producer, "STOP_WAIT_S", 1.0)  # keep the test short
    STOP_WAIT_S = 1.0

    release = threading.Event()
    started = threading.Event()

    def generate(prompts, index):
        if index == 0:
            return [FakeRollout(0)]
        started.set()
        release.wait(600)  # a generation stuck in the engines
        return [FakeRollout(0)]

    t0 = None
    with pytest.raises(type(error)):
        with RolloutProducer(generate, [[0], [1], [2]], 1) as producer:
            for _ in producer:
                assert started.wait(10)
                t0 = time.monotonic()
                raise error
    assert time.monotonic() - t0 < STOP_WAIT_S + 2
    release.set()  # let the abandoned daemon thread end: its result is dropped, never queued


def test_with_a_filter_the_queue_holds_full_batches_and_ends_when_the_filter_runs_out():
    """--async_train --dynamic_filtering: the producer fills each step's batch through the filter (here: keeps the
    even prompts, refilling from the loader) and queues only full batches; the run ends when the data runs out."""
    from types import SimpleNamespace

    def fill(batches, step):
        kept = []
        for batch in batches:
            kept += [p for p in batch if p % 2 == 0]
            if len(kept) >= 2:
                return SimpleNamespace(prompts=kept[:2], rollouts=[f"r{p}" for p in kept[:2]], step=step)
        return None

    loader = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    got = []
    with RolloutProducer(lambda p, i: None, loader, 1, fill=fill) as producer:
        for item in producer:
            got.append((item.prompts, item.rollouts, item.filled.step))
    assert got == [([0, 2], ["r0", "r2"], 0), ([4, 6], ["r4", "r6"], 1)]  # 8 alone cannot fill a third batch


def test_several_batches_per_generation_are_generated_together_and_queued_one_by_one():
    """--vllm_generate_batch_size = 2 x --rollout_batch_size: one generate call for two loader batches (the first
    one's index for its seeds), the rollouts split back per batch with prompt indices counted within it."""
    from orlhf.types import Rollout

    calls = []

    def generate(prompts, index):
        calls.append((list(prompts), index))
        return [Rollout(i, [p], [p, p], [0.0, 0.0], True) for i, p in enumerate(prompts) for _ in range(2)]

    loader = [[10, 11], [12, 13], [14, 15]]
    got = []
    with RolloutProducer(generate, loader, 2, batches_per_generation=2) as producer:
        for item in producer:
            got.append((item.prompts, [(r.prompt_index, r.prompt_ids[0]) for r in item.rollouts]))
    assert calls == [([10, 11, 12, 13], 0), ([14, 15], 2)]
    assert got[1] == ([12, 13], [(0, 12), (0, 12), (1, 13), (1, 13)])
    assert [p for p, _ in got] == loader


class GatedLoader:
    """Prompt batches [0] .. [n-1] from `steps_done` on; batch i >= 2 is read only once `opened[i]` is set: the
    producer then starts generating it later than the trainer's sync asks for the lock (a slow thread on a busy
    machine), the order in which the sync used to win."""

    def __init__(self, n: int, steps_done: int = 0):
        self.n, self.steps_done = n, steps_done
        self.opened = [threading.Event() for _ in range(n + 1)]
        for event in self.opened[: steps_done + 2]:
            event.set()

    def __iter__(self):
        for i in range(self.steps_done, self.n):
            self.opened[i].wait()
            yield [i]


def train(producer, loader, version: list, steps=None) -> list:
    """The controller's async loop (Controller.fit_async): a stop is checked before taking a batch; after taking
    batch i the next one is let through the loader, then the sync. Returns (batch, generated at version) pairs."""
    trained = []
    with producer:
        while steps is None or len(trained) < steps:
            item = producer.next()
            if item is None:
                break
            trained.append((item.prompts[0], item.rollouts[0].weight_version))
            loader.opened[item.prompts[0] + 1].set()
            with producer.gate.sync():
                version[0] += 1
        pending = producer.pending()
    return trained, pending


def test_each_batch_is_generated_with_the_weights_before_the_previous_ones_sync():
    """Queue size 1: batch i is given its slot when batch i - 1 is taken, before that batch's sync, so it is
    generated with the weights of version i - 1 (batches 0 and 1: version 0), however late its thread starts: the
    sync waits until the producer holds the lock (SyncGate.settle). Before, the sync took the lock first whenever the
    producer's thread was slower, and an async run did not repeat itself."""
    version = [0]
    loader = GatedLoader(6)

    def generate(prompts, index):
        return [FakeRollout(version[0])]

    trained, _ = train(RolloutProducer(generate, loader, 1), loader, version)
    assert trained == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]


def test_a_stop_keeps_the_batches_generated_ahead_and_a_resume_trains_them_as_they_were():
    """Stopped after 3 steps, the producer's queue holds batch 3, generated with version 2 (pending()). A producer
    given it (as a resumed checkpoint does) and the loader at step 3 trains it first, without generating it again,
    then generates batch 4 with version 3: the uninterrupted run's sequence, batch for batch."""
    version, calls = [0], []

    def generate(prompts, index):
        calls.append(index)
        return [FakeRollout(version[0])]

    loader = GatedLoader(6)
    uninterrupted, _ = train(RolloutProducer(generate, loader, 1), loader, version)

    version, calls[:] = [0], []
    loader = GatedLoader(6)
    first, (pending, left_out) = train(RolloutProducer(generate, loader, 1), loader, version, steps=3)
    assert [batch.rollouts[0].weight_version for batch in pending] == [2] and left_out == 0
    assert calls == [0, 1, 2, 3]
    loader = GatedLoader(6, steps_done=3)
    resumed, _ = train(RolloutProducer(generate, loader, 1, pending=pending), loader, version)
    assert calls == [0, 1, 2, 3, 4, 5]  # batch 3 was not generated again
    assert first + resumed == uninterrupted


def test_a_checkpoint_keeps_the_rollouts_exactly(tmp_path):
    """What pending() returns goes into the controller's state (run_state.pack_rollouts: JSON + safetensors) and comes
    back field for field: tokens, each engine log-prob to the last bit, versions, the agents' fields."""
    import torch

    from orlhf.storage.checkpoint_state import load_state, save_state
    from orlhf.trainer.run_state import pack_rollouts, unpack_rollouts
    from orlhf.types import Rollout

    rollouts = [
        Rollout(0, [5, 6], [7, 8, 2], [-0.1234567890123456, -1e-300, -17.0], True, engine=1, weight_version=3,
                token_versions=[2, 3, 3]),
        Rollout(0, [5, 6], [], [], False, weight_version=2, action_mask=[], reward=0.5, score=1.0,
                extra_logs={"turns": 2.0}),
        Rollout(1, [9], [4, 4], [-2.5, -0.75], False, action_mask=[1, 0]),
    ]  # fmt: skip
    save_state(tmp_path, "controller", {"pending": [{"rollouts": pack_rollouts(rollouts), "seconds": 1.5}]})
    (batch,) = load_state(tmp_path, "controller")["pending"]
    assert unpack_rollouts(batch["rollouts"]) == rollouts and batch["seconds"] == 1.5
    seen = Rollout(0, [1], [2], [-1.0], True, vision={"pixel_values": torch.arange(6.0).reshape(2, 3)})
    save_state(tmp_path, "vision", {"r": pack_rollouts([seen])})
    (back,) = unpack_rollouts(load_state(tmp_path, "vision")["r"])
    assert torch.equal(back.vision["pixel_values"], seen.vision["pixel_values"])
