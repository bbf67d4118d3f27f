"""distributed.ray_start.connect_ray's own local cluster (launch.run.run_locked starts it): without --verbose, started
without the autoscaler monitor, the log monitor and the dashboard head, and still runs actors and placement groups;
ray.init's RayParams is left as it was afterwards.

Real Ray: each case starts and ends a local cluster, so the session's shared one is shut down first.
"""

import os

import pytest

ray = pytest.importorskip("ray")

from ray._private import parameter  # noqa: E402
from ray._private.node import Node  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from orlhf.config.flags import build_config  # noqa: E402
from orlhf.distributed.ray_start import connect_ray  # noqa: E402

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=1)
class Echo:
    def ping(self, x):
        return x + 1


@pytest.fixture
def own_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()  # the session's cluster (conftest.ray_local starts a new one when next asked)
    yield
    ray.shutdown()


def running_types() -> set[str]:
    node = ray._private.worker._global_node
    return {kind for kind, procs in node.all_processes.items() if procs}


@pytest.mark.parametrize("verbose", [False, True])
def test_own_cluster_leaves_out_the_monitors_unless_verbose_and_still_runs(own_cluster, verbose):
    original, start_api_server = parameter.RayParams.__init__, Node.start_api_server
    cfg = build_config({"verbose": verbose}, explicit={"verbose"})
    assert connect_ray(cfg, num_cpus=2) is True  # started here: run_locked shuts it down
    assert parameter.RayParams.__init__ is original  # only ray.init's own RayParams were changed
    assert Node.start_api_server is start_api_server  # and its own Node
    kinds = running_types()
    assert ("monitor" in kinds) is verbose  # --verbose: Ray's processes as ray.init starts them
    assert ("log_monitor" in kinds) is verbose  # (it forwards workers' output to the terminal)
    assert ("dashboard" in kinds) is verbose  # the dashboard head, which ray.init waits for
    assert {"gcs_server", "raylet"} <= kinds
    pg = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    actor = Echo.options(placement_group=pg).remote()
    assert ray.get(actor.ping.remote(41), timeout=60) == 42
    remove_placement_group(pg)
    # Ray's socket connections retry every 0.1 s in this cluster's processes (ray_start.QUICK_CONNECTS)
    assert ray.get(connect_settings.remote(), timeout=60) == (100, 100)


@ray.remote(num_cpus=1)
def connect_settings():
    from ray._raylet import Config

    return Config.raylet_client_connect_timeout_milliseconds(), Config.raylet_client_num_connect_attempts()


def test_an_initialized_ray_is_joined_not_started(own_cluster):
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    assert connect_ray(build_config({}), num_cpus=2) is False
    assert "monitor" in running_types()  # ray.init's defaults, untouched


@ray.remote(num_cpus=1, max_concurrency=2)
class Threads:
    """Reports what the worker preloaded and its torch threads, on the actor's thread and on a new one."""

    def __init__(self):
        import sys

        from orlhf.cpu.threads import threads_as_ray_set

        self.preloaded = "orlhf.cpu.preload" in sys.modules and "transformers.modeling_utils" in sys.modules
        threads_as_ray_set()  # as CPU rank actors and engines do first (CpuRankActor, CpuTuning.engine_start)

    def report(self):
        import os
        import threading

        import torch

        other = []
        t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        t.start()
        t.join()
        return self.preloaded, os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads(), other[0]


@ray.remote(num_cpus=2)
class Threads2(Threads.__ray_actor_class__):
    pass


def test_a_cpu_runs_own_cluster_preloads_torch_and_actors_keep_the_threads_ray_gives_them(own_cluster, monkeypatch):
    monkeypatch.delenv("ORLHF_NO_PRELOAD", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # Ray prestarts min(cores, num_cpus) workers: 2 for 2 processes
    from orlhf.cpu.tuning import CpuTuning

    cfg = build_config({"device": "cpu"}, explicit={"device"})
    assert connect_ray(cfg, num_cpus=4, processes=2, tuning=CpuTuning.for_config(cfg)) is True
    # torch read the thread count at import, before Ray set OMP_NUM_THREADS for the actor: threads_as_ray_set
    # applies Ray's value, on every thread (the machine's cores would be used otherwise)
    one, two = Threads.remote(), Threads2.remote()
    assert ray.get([one.report.remote(), two.report.remote()], timeout=120) == [(True, "1", 1, 1), (True, "2", 2, 2)]


def test_preload_only_on_cpu_where_the_prestarted_workers_are_the_runs_own(monkeypatch):
    from orlhf.cpu.tuning import worker_preload

    monkeypatch.delenv("ORLHF_NO_PRELOAD", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cpu = build_config({"device": "cpu"}, explicit={"device"})
    assert worker_preload(cpu, num_cpus=4, processes=2) == {
        "_system_config": {"preload_python_modules": ["orlhf.cpu.preload"]}
    }
    assert worker_preload(build_config({"device": "cuda"}, explicit={"device"}), num_cpus=4, processes=2) == {}
    monkeypatch.setattr("os.cpu_count", lambda: 16)  # 16 prestarted workers for 2 processes: 14 would load for nothing
    assert worker_preload(cpu, num_cpus=16, processes=2) == {}
    assert worker_preload(cpu, num_cpus=16, processes=15)  # a run that takes them
    monkeypatch.setenv("ORLHF_NO_PRELOAD", "1")
    assert worker_preload(cpu, num_cpus=16, processes=15) == {}


@ray.remote(num_cpus=1)
def env_of_worker(name):
    import os

    return os.environ.get(name)


@ray.remote(num_cpus=1)
def niceness_of_worker():
    import os

    return os.nice(0)


def test_own_cpu_cluster_gives_its_workers_one_malloc_arena_and_leaves_the_driver_env(own_cluster, monkeypatch):
    """CpuTuning.cluster_env reaches the workers through the raylet (cpu/memory.py: glibc reads it as a process
    starts); the driver's environment is as it was."""
    from orlhf.cpu.tuning import CpuTuning

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    cfg = build_config({"device": "cpu"}, explicit={"device"})
    assert connect_ray(cfg, num_cpus=2, tuning=CpuTuning()) is True
    assert ray.get(env_of_worker.remote("MALLOC_ARENA_MAX"), timeout=60) == "1"
    # the workers at the driver's priority (cpu/threads.cluster_priority_env), not Ray's lowered default (15)
    assert ray.get(niceness_of_worker.remote(), timeout=60) == os.nice(0)
    assert "MALLOC_ARENA_MAX" not in os.environ and "RAY_worker_niceness" not in os.environ
