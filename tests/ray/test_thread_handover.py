"""CPU threads handed over per phase (orlhf/cpu/threads.py) on real Ray rank actors: the working call sees the count.

2 CPU rank actors (cpu/rank_actor.py; Ray: OMP_NUM_THREADS=1; Ray runs each actor's calls on a pool of threads)
  work() x 4, one after another   -> 1 torch thread, and all four on one thread per rank (the compute thread)
  PhaseThreads.before("train")  (cores 4, 2 ranks working: 2 each)
  work() x 4, one after another   -> 2 threads, on that same thread (which ran torch code with 1 before)
  work() x 2 at once              -> 2 threads on both: an overlapping call runs on a pool thread, with the count
"""

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import ray.cloudpickle
import torch

from orlhf.cpu.hosting import CpuGroup, cpu_group
from orlhf.cpu.threads import PhaseThreads
from orlhf.distributed.endpoints import endpoint
from orlhf.distributed.placement import RankBundle

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


def observed(group: CpuGroup, at_once: int) -> dict:
    """{(rank, thread): torch threads seen inside work()}: four calls one after another (at_once=1), or
    at_once calls in flight together."""
    seen = {}
    if at_once == 1:
        results = [group.call(WorkProbe.work, 0.0).get() for _ in range(4)]
    else:
        calls = [group.call(WorkProbe.work, 0.5) for _ in range(at_once)]
        results = [call.get() for call in calls]
    for result in results:
        for rank, (thread, n) in enumerate(result):
            seen[(rank, thread)] = n
    return seen


def test_the_working_ranks_get_the_cores_on_one_compute_thread(ray_local):
    group = cpu_group("actor", WorkProbe, cfg=None, slots=[RankBundle(None, 0, 1.0)] * 2, device="cpu", timeout_s=60)
    try:
        before = observed(group, 1)
        assert len(before) == 2, f"calls one after another should share one thread per rank: {before}"
        assert set(before.values()) == {1}  # Ray's OMP_NUM_THREADS=1
        # vLLM engines generate: no model group of the run works in the generate phase (RolloutBackend)
        models = SimpleNamespace(
            actor=group, ref=None, critic=None, reward=None, rollout=SimpleNamespace(generating_groups=())
        )
        cfg = SimpleNamespace(
            runtime=SimpleNamespace(device="cpu"),
            ppo=SimpleNamespace(async_train=False),
            deepspeed=SimpleNamespace(train_cpu_threads=0),
            vllm=SimpleNamespace(cpu_threads=0, num_engines=1, tensor_parallel_size=1),
            single_pass=True,
            reference_from_actor=False,
            num_engines=1,
        )
        threads = PhaseThreads.from_config(cfg, models, cores=4)
        threads.before("train")
        after = observed(group, 1)
        assert set(after) == set(before)  # the same compute threads, which had run torch with 1 thread
        assert set(after.values()) == {2}
        overlapping = observed(group, 2)
        assert len(overlapping) == 4, f"two calls at once should run on two threads per rank: {overlapping}"
        assert set(overlapping) >= set(before) and set(overlapping.values()) == {2}
    finally:
        group.shutdown()
