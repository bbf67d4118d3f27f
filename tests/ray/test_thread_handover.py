"""CPU threads handed over per phase (orlhf/threads.py) on real Ray rank actors: the working call sees the count.

    2 rank actors (Ray: OMP_NUM_THREADS=1, calls on a pool of 2 threads each)
      work() x 4 at once      -> 1 thread on every pool thread (as Ray started them)
      PhaseThreads.before("train")  (cores 4, 2 ranks working: 2 each)
      work() x 4 at once      -> 2 threads on every pool thread, also on threads that ran torch code before
"""

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import ray.cloudpickle
from orlhf.cluster import ActorGroup
from orlhf.endpoints import endpoint
from orlhf.placement import RankBundle
from orlhf.threads import PhaseThreads

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class WorkProbe:
    """A phase's work in miniature: a parallel torch op, then the threads the op ran with and on which thread."""

    def __init__(self, cfg):
        self.cfg = cfg

    @endpoint
    def work(self, hold_s: float):
        torch.ones(256, 256) @ torch.ones(256, 256)  # an OpenMP region: the pool thread's count is now fixed
        time.sleep(hold_s)  # keep this pool thread busy so the concurrent call lands on the other one
        return threading.get_ident(), torch.get_num_threads()


def observed(group: ActorGroup) -> dict:
    """{(rank, pool thread): threads seen inside work()}, four calls per rank at once (both pool threads)."""
    calls = [group.call(WorkProbe.work, 0.5) for _ in range(4)]
    seen = {}
    for call in calls:
        for rank, (thread, n) in enumerate(call.get()):
            seen[(rank, thread)] = n
    return seen


def test_the_working_ranks_get_the_cores_on_every_pool_thread(ray_local):
    group = ActorGroup("actor", WorkProbe, cfg=None, slots=[RankBundle(None, 0, 1.0)] * 2, device="cpu",
                       timeout_s=60)
    try:
        before = observed(group)
        assert len(before) == 4, f"expected 2 pool threads per rank: {before}"
        assert set(before.values()) == {1}  # Ray's OMP_NUM_THREADS=1
        models = SimpleNamespace(actor=group, ref=None, critic=None, reward=None, engines=[])
        cfg = SimpleNamespace(runtime=SimpleNamespace(device="cpu"), ppo=SimpleNamespace(async_train=False),
                              deepspeed=SimpleNamespace(train_cpu_threads=0),
                              vllm=SimpleNamespace(cpu_threads=0, num_engines=1, tensor_parallel_size=1),
                              single_pass=True)
        threads = PhaseThreads.from_config(cfg, models, cores=4)
        threads.before("train")
        after = observed(group)
        assert set(after) >= set(before)  # the same pool threads, which had run torch with 1 thread
        assert set(after.values()) == {2}
    finally:
        group.shutdown()
