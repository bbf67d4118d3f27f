"""ActorGroup on a real local Ray cluster: rendezvous env, call, call_sharded order, error surfacing."""

import os
import sys
import time

import pytest
import ray.cloudpickle
import torch

from orlhf.distributed.endpoints import endpoint
from orlhf.distributed.groups import ActorGroup, RankError, shard, wait_calls
from orlhf.distributed.placement import RankBundle
from orlhf.types import SequenceBatch

pytestmark = pytest.mark.ray
# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EchoWorker:
    """Records its rendezvous env; doubles what it is given; fails on request."""

    def __init__(self, cfg):
        self.cfg = cfg

    @endpoint
    def env(self):
        return {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}

    @endpoint
    def double(self, batch: SequenceBatch):
        return batch.sequences[:, 0] * 2

    @endpoint
    def rank_of_rows(self, rows: list):
        return [(int(os.environ["RANK"]), r) for r in rows]

    @endpoint
    def boom(self, rank_to_fail: int):
        if int(os.environ["RANK"]) == rank_to_fail:
            raise ValueError("deliberate failure on this rank")
        time.sleep(30)  # the healthy ranks would hang in a collective; the group must not wait for them
        return "done"

    def private(self):  # not exported: the group refuses to call it
        return "secret"


def batch(n):
    seq = torch.arange(n).unsqueeze(1).repeat(1, 3)
    return SequenceBatch(seq, torch.ones_like(seq), torch.ones(n, 1, dtype=torch.bool))


def test_shard_pads_to_equal_chunks():
    chunks = shard(batch(5), 2)
    assert [len(c) for c in chunks] == [3, 3]
    assert chunks[1].sequences[:, 0].tolist() == [3, 4, 4]  # the last row repeated
    assert shard([1, 2, 3], 3) == [[1], [2], [3]]


def test_group_rendezvous_sharding_and_errors(ray_local):
    group = ActorGroup(
        "critic",
        EchoWorker,
        cfg={"x": 1},
        slots=[RankBundle(None, 0, 0.5)] * 3,
        device="cpu",
        gpus_per_node=3,
        timeout_s=60,
    )
    try:
        envs = group.call(EchoWorker.env).get()
        assert [e["RANK"] for e in envs] == ["0", "1", "2"]
        assert {e["WORLD_SIZE"] for e in envs} == {"3"}
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]

        out = group.call_sharded(EchoWorker.double, batch(7)).get_cat()  # 7 rows over 3 ranks: padded to 9, trimmed
        assert out.tolist() == [2 * i for i in range(7)]
        ranks = group.call_sharded(EchoWorker.rank_of_rows, list(range(6))).get()
        assert [r for part in ranks for r in part] == [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]

        t0 = time.monotonic()
        with pytest.raises(RankError) as err:
            group.call(EchoWorker.boom, 1).get()
        assert time.monotonic() - t0 < 20, "the group waited for the healthy ranks"
        assert err.value.role == "critic" and err.value.rank == 1 and err.value.method == "boom"
        assert "deliberate failure on this rank" in str(err.value)
        assert "in boom" in str(err.value) and "\x1b[" not in str(err.value)  # the remote traceback, uncoloured

        # two calls waited together end at the first failure, whichever call it is in. (Ranks 0 and 2 still
        # sleep in boom(1): each rank runs two calls at a time, so one slot is left on every rank.)
        t0 = time.monotonic()
        with pytest.raises(RankError) as err:
            wait_calls(group.call_rank(0, EchoWorker.env), group.call(EchoWorker.boom, 2), timeout_s=60)
        assert time.monotonic() - t0 < 20 and err.value.rank == 2 and err.value.method == "boom"

        with pytest.raises(TimeoutError, match=r"critic: boom\(\) did not finish on rank\(s\) \[0, 1, 2\]"):
            group.call(EchoWorker.boom, -1).get(timeout_s=2)

        with pytest.raises(TypeError, match=r"critic: EchoWorker.private is not exported to its group"):
            group.call(EchoWorker.private)
        with pytest.raises(TypeError, match="by reference, not by the string 'env'"):
            group.call("env")
    finally:
        group.shutdown()


def test_a_worker_class_that_exports_nothing_is_refused_before_any_rank_starts():
    class Unmarked:
        def __init__(self, cfg):
            pass

        def env(self):
            return {}

    # no ray_local fixture: the check runs before any actor is spawned, so no cluster is needed
    with pytest.raises(TypeError, match="Unmarked exports no methods; mark the ones its group calls with @endpoint"):
        ActorGroup("critic", Unmarked, cfg={}, slots=[RankBundle(None, 0, 0.5)], device="cpu")
