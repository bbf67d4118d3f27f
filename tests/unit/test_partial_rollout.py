"""--partial_rollout: a batch generated in segments (rollout/partial.py) and a weight sync let in between two of them
(trainer/async_producer.py SyncGate). Pure logic, with stand-in engines whose "model" answers each sample with a
fixed number of tokens before EOS; the engine path itself runs in tests/e2e/test_partial_rollout.py."""

import threading
import time
from types import SimpleNamespace

import pytest

from orlhf.config.flags import build_config
from orlhf.config.ppo_config import PPOConfig
from orlhf.config.train_config import ConfigError
from orlhf.rollout.partial import PartialGenerator, turn_versions, version_stats
from orlhf.trainer.async_producer import RolloutProducer, SyncGate
from orlhf.trainer.experience import rollouts_to_batch
from orlhf.types import Rollout, SamplingSpec, continuation_seed, max_new_tokens, request_seed

EOS = 2


class StandInEngines:
    """Two engines. Sample k of prompt i says `lengths[(i, k)]` tokens, the last one EOS; token t of a response is
    100 + t, its log-prob -t / 10. Every rollout carries the engines' current `version`; `between` (the hook the
    generator calls between segments) may change it, as a weight sync would."""

    def __init__(self, lengths: dict, version: int = 0):
        self.lengths, self.version = lengths, version
        self.calls: list = []  # ("generate", max tokens) | ("requests", {engine: [GenerationRequest]})
        self.rows: dict = {}  # row of the batch -> (prompt index, sample number, prompt length)

    def _answer(self, key, row, ids, max_tokens, engine) -> Rollout:
        i, k, prompt_len = self.rows[row]
        done = len(ids) - prompt_len
        total = self.lengths[(i, k)]
        new = list(range(done, min(total, done + max_tokens)))
        ids_new = [EOS if t == total - 1 else 100 + t for t in new]
        finished = bool(ids_new) and ids_new[-1] == EOS
        return Rollout(key, list(ids), ids_new, [-t / 10 for t in new], finished, engine, self.version)

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[Rollout]:
        self.calls.append(("generate", sampling.max_new_tokens))
        out = []
        for i, ids in enumerate(prompts):
            for k in range(sampling.n):
                row = len(self.rows)
                self.rows[row] = (i, k, len(ids))
                out.append(self._answer(i, row, ids, max_new_tokens(sampling, len(ids)), i % 2))
        return out

    def generate_requests(self, per_engine: dict, sampling: SamplingSpec) -> list[Rollout]:
        self.calls.append(("requests", per_engine))
        return [
            self._answer(r.key, r.key, r.ids, r.max_tokens, engine)
            for engine, requests in sorted(per_engine.items())
            for r in requests
        ]


def run(lengths, n=2, prompts=2, tokens=4, cap=20, between=None, engines=None):
    engines = engines or StandInEngines(lengths)
    sampling = SamplingSpec(max_new_tokens=cap, n=n, seed=7)
    batch = [SimpleNamespace(ids=[1] * (3 + i)) for i in range(prompts)]
    return PartialGenerator(engines, tokens, between).generate(batch, sampling), engines


def test_unfinished_samples_continue_alone_from_their_tokens_finished_ones_are_left_alone():
    lengths = {(0, 0): 3, (0, 1): 10, (1, 0): 25, (1, 1): 4}  # EOS at token 3, 10, never (cap 20), 4
    rollouts, engines = run(lengths)
    assert engines.calls[0] == ("generate", 4)  # segment 0: the batch's own requests, at most 4 new tokens
    assert [len(r.response_ids) for r in rollouts] == [3, 10, 20, 4]
    assert [r.finished for r in rollouts] == [True, True, False, True]  # the third was cut at --generate_max_len
    assert [r.prompt_ids for r in rollouts] == [[1] * 3, [1] * 3, [1] * 4, [1] * 4]  # the prompt alone
    assert rollouts[2].response_ids == [100 + t for t in range(20)]  # the segments joined in order, no gap
    assert rollouts[1].logprobs == [-t / 10 for t in range(10)]  # each token keeps its own log-prob
    segments = [c[1] for c in engines.calls[1:]]
    assert len(segments) == 4  # 20 tokens in segments of 4: the cap is reached after the fifth call
    first = segments[0]
    assert sorted((e, r.key) for e, reqs in first.items() for r in reqs) == [(0, 1), (1, 2)]  # own engine, rows 1, 2
    row1 = first[0][0]
    assert row1.ids == [1, 1, 1, 100, 101, 102, 103] and row1.n == 1 and row1.max_tokens == 4
    assert row1.seed == continuation_seed(request_seed(7, 0), 1, 1)  # prompt 0's seed, its sample 1, segment 1
    assert first[1][0].seed == continuation_seed(request_seed(7, 1), 0, 1)
    later = [sorted(r.key for reqs in seg.values() for r in reqs) for seg in segments[1:]]
    assert later == [[1, 2], [2], [2]]  # row 1 stopped at its token 10 (segment 2): only row 2 goes on
    assert segments[-1][1][0].seed == continuation_seed(request_seed(7, 1), 0, 4)
    assert all(r.token_versions == [0] * len(r.response_ids) for r in rollouts)


def test_a_continuation_asks_only_for_the_tokens_left():
    rollouts, engines = run({(0, 0): 50}, n=1, prompts=1, tokens=4, cap=10)
    assert [r.max_tokens for c in engines.calls[1:] for reqs in c[1].values() for r in reqs] == [4, 2]
    assert len(rollouts[0].response_ids) == 10 and not rollouts[0].finished


def test_every_token_keeps_the_version_it_was_sampled_with():
    engines = StandInEngines({(0, 0): 2, (0, 1): 12}, version=5)

    def between():  # a weight sync lands before segment 2
        if len(engines.calls) == 2:
            engines.version += 1

    rollouts, _ = run(engines.lengths, prompts=1, between=between, engines=engines)
    assert rollouts[0].token_versions == [5, 5] and rollouts[0].weight_version == 5  # stopped in segment 0
    assert rollouts[1].token_versions == [5] * 8 + [6] * 4  # segments 0, 1 under version 5; segment 2 under 6
    assert rollouts[1].weight_version == 5  # the oldest token's: staleness and the sync guard see it stale
    _, engine_log_probs = rollouts_to_batch(rollouts, 0)  # what IS correction and the guard read
    assert engine_log_probs[1].tolist() == pytest.approx([-t / 10 for t in range(12)])  # per token, either version
    stats = version_stats(rollouts, trainer_version=6)
    assert stats["token_staleness_max"] == 1.0 and stats["crossed_sync_frac"] == 0.5
    assert stats["token_staleness_mean"] == pytest.approx((2 + 8) / 14)


def test_the_gate_lets_a_waiting_sync_in_between_two_segments_only():
    """The producer generates in 6 segments; the trainer asks for a sync during the first. The sync runs before the
    generation ends, never during an engine call, and the batch's generation seconds leave the sync's time out."""
    events = []
    in_call = threading.Event()
    sync_asked = threading.Event()
    producer = None

    def generate(prompts, index):
        for segment in range(6):
            if segment:
                producer.gate.yield_to_sync()
            in_call.set()
            events.append(("segment", segment))
            if segment == 0:
                assert sync_asked.wait(10)
                time.sleep(0.05)  # the sync is now blocked on the lock, waiting
            in_call.clear()
        return [SimpleNamespace(weight_version=0)]

    def trainer_sync():
        assert in_call.wait(10)
        sync_asked.set()
        with producer.gate.sync():
            events.append(("sync", in_call.is_set()))
            time.sleep(0.3)

    producer = RolloutProducer(generate, [[0]], 1)
    syncer = threading.Thread(target=trainer_sync)
    syncer.start()
    with producer:
        got = list(producer)
    syncer.join(10)
    assert events[:3] == [("segment", 0), ("sync", False), ("segment", 1)]  # right after the segment in flight
    assert producer.gate.yields == 1
    assert got[0].seconds < 0.3  # generation seconds: the sync's 0.3 s are not the generation's


def test_without_a_waiting_sync_the_producer_keeps_the_lock():
    gate = SyncGate()
    with gate.lock:
        assert gate.yield_to_sync() is False
        assert gate.lock.locked()
    with gate.sync():  # uncontended, as in sync mode
        assert gate.lock.locked()
    assert not gate.lock.locked()


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"partial_rollout": True}, "--partial_rollout requires --async_train"),
        ({"partial_rollout": True, "async_train": True, "partial_rollout_tokens": 0}, "must be >= 1"),
        ({"partial_rollout_tokens": 64}, "--partial_rollout_tokens does nothing without --partial_rollout"),
        ({"partial_rollout": True, "rollout_backend": "trainer"}, "--partial_rollout lets weight syncs into the vLLM"),
        (
            {"partial_rollout": True, "async_train": True, "agent_func_path": "agent.py", "partial_rollout_tokens": 8},
            "--partial_rollout_tokens cuts single-turn generations",
        ),
    ],
)
def test_refusals_name_the_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"device": "cpu", **flags}, explicit=set(flags))


def test_accepted_with_async_train_and_the_segment_default():
    cfg = build_config({"device": "cpu", "partial_rollout": True, "async_train": True}, explicit=set())
    assert cfg.ppo.partial_rollout and cfg.ppo.partial_rollout_segment == 256  # at least 256 tokens a call
    assert PPOConfig(generate_max_len=16000).partial_rollout_segment == 2000  # at most 8 calls for the longest
    assert PPOConfig(generate_max_len=16000, partial_rollout_tokens=16).partial_rollout_segment == 16


def test_an_agent_episode_s_tokens_get_their_turn_s_version():
    # prompt of 2 tokens; turn 1 = tokens 2..4 (v3), feedback 4..5, turn 2 = tokens 5..7 (v4), feedback 7..8
    assert turn_versions([(2, 4), (5, 7)], 2, 6, [3, 4]) == [3, 3, 3, 4, 4, 4]
    # a custom executor with another number of action ranges than turns: every token counts as the oldest
    assert turn_versions([(2, 7)], 2, 6, [3, 4]) == [3] * 6
