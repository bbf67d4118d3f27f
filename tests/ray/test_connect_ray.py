"""raystart.connect_ray's own local cluster (entry.run_locked starts it): without --verbose, started without the
autoscaler monitor and the log monitor, and still runs actors and placement groups; ray.init's RayParams is left as
it was afterwards.

Real Ray: each case starts and ends a local cluster (~7 s), so the session's shared one is shut down first.
"""

import pytest

ray = pytest.importorskip("ray")

from ray._private import parameter  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from orlhf.flags import build_config  # noqa: E402
from orlhf.raystart import connect_ray  # noqa: E402

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
    original = parameter.RayParams.__init__
    cfg = build_config({"verbose": verbose}, explicit={"verbose"})
    assert connect_ray(cfg, num_cpus=2) is True  # started here: run_locked shuts it down
    assert parameter.RayParams.__init__ is original  # only ray.init's own RayParams were changed
    kinds = running_types()
    assert ("monitor" in kinds) is verbose  # --verbose: Ray's processes as ray.init starts them
    assert ("log_monitor" in kinds) is verbose  # (it forwards workers' output to the terminal)
    assert {"gcs_server", "raylet"} <= kinds
    pg = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    actor = Echo.options(placement_group=pg).remote()
    assert ray.get(actor.ping.remote(41), timeout=60) == 42
    remove_placement_group(pg)


def test_an_initialized_ray_is_joined_not_started(own_cluster):
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    assert connect_ray(build_config({}), num_cpus=2) is False
    assert "monitor" in running_types()  # ray.init's defaults, untouched
