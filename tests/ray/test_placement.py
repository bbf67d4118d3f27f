"""Placement groups on a simulated 3-node cluster (4 fake GPUs + 4 CPUs per node, head included).

One cluster for the module (each node is a slow Ray start); each case removes its placement groups, so every
case sees all 12 GPUs free. What is checked: every node-group lands whole on one node (STRICT_PACK), each TP
engine on one node, ranks map to (group, bundle, share) as the layout says, fractional shares co-schedule on one
bundle, and what cannot be placed fails fast with the needed-vs-available table.
"""

import contextlib
import json
import time

import pytest

ray = pytest.importorskip("ray")

from ray.util import placement_group_table  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

from orlhf.cli import main  # noqa: E402
from orlhf.config.flags import build_config  # noqa: E402
from orlhf.config.resolve import resolve_device  # noqa: E402
from orlhf.distributed import layout as L  # noqa: E402
from orlhf.distributed import placement as P  # noqa: E402
from orlhf.launch.bringup import run_layout  # noqa: E402

pytestmark = pytest.mark.ray
NODE = {"num_cpus": 4, "num_gpus": 4, "include_dashboard": False}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the session's local cluster (conftest.ray_local starts a new one when next asked)
    c = Cluster(initialize_head=True, head_node_args=NODE)
    try:
        for _ in range(2):
            c.add_node(**{k: v for k, v in NODE.items() if k != "include_dashboard"})
        c.wait_for_nodes(timeout=60)
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    d.joinpath("config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "intermediate_size": 128,
                "vocab_size": 100,
                "num_attention_heads": 4,
            }
        )
    )
    return str(d)


def cfg_of(**flags):
    return build_config(flags, explicit=set(flags))


def layout_of(cfg, device: str):
    """plan_layout on `device`, as a finished config carries it."""
    return run_layout(resolve_device(cfg, device))


@contextlib.contextmanager
def placed(cfg, device="cuda", timeout_s=30):
    layout = layout_of(cfg, device)
    result = P.create_placement_groups(layout, timeout_s=timeout_s)
    try:
        yield result
    finally:
        P.remove_placement_groups(result)


def bundle_nodes(pg) -> dict:
    return placement_group_table(pg)["bundles_to_node_id"]


def assert_groups_whole(result):
    """Every node-group's bundles on one node; returns {node id: slots placed there}."""
    per_node: dict = {}
    for (pool, _g), pg in result.groups.items():
        nodes = bundle_nodes(pg)
        assert len(nodes) == result.layout.pool(pool).group_size
        assert len(set(nodes.values())) == 1, (pool, nodes)
        node = next(iter(nodes.values()))
        per_node[node] = per_node.get(node, 0) + len(nodes)
    return per_node


def live_groups() -> int:
    return sum(1 for t in placement_group_table().values() if t["state"] != "REMOVED")


def test_split_placement_fills_the_cluster(cluster, rm_dir):
    cfg = cfg_of(
        reward_pretrain=rm_dir,
        actor_num_gpus_per_node=4,
        ref_num_gpus_per_node=2,
        critic_num_gpus_per_node=2,
        reward_num_gpus_per_node=2,
        vllm_tensor_parallel_size=2,
    )
    with placed(cfg) as r:
        assert sorted(assert_groups_whole(r).values()) == [4, 4, 4]  # 4 + 2 + 2 + 2 + 2 = 12 GPUs
        actor = r.role_bundles("actor")
        assert [(b.bundle_index, b.share) for b in actor] == [(i, 1.0) for i in range(4)]
        assert all(b.placement_group is actor[0].placement_group for b in actor)
        engine = r.engine_bundles(0)
        assert engine.bundle_indices == [0, 1] and engine.share == 1.0
        assert engine.placement_group.bundle_specs == [{"GPU": 1.0, "CPU": 1.0}] * 2
    assert live_groups() == 0


def test_colocate_actor_ref(cluster):
    cfg = cfg_of(
        actor_num_nodes=2,
        actor_num_gpus_per_node=2,
        ref_num_nodes=2,
        ref_num_gpus_per_node=2,
        colocate_actor_ref=True,
        critic_num_gpus_per_node=2,
        vllm_num_engines=2,
        vllm_tensor_parallel_size=2,
    )
    with placed(cfg) as r:
        assert_groups_whole(r)
        assert set(p.name for p in r.layout.pools) == {"actor+ref", "critic", "vllm0", "vllm1"}
        for a, b in zip(r.role_bundles("actor"), r.role_bundles("ref")):  # rank i of both on the same bundle
            assert (a.placement_group, a.bundle_index, a.share) == (b.placement_group, b.bundle_index, 0.5)
        assert r.role_bundles("actor")[2].placement_group is r.groups[("actor+ref", 1)]  # rank 2 -> group 1


def test_colocate_critic_reward(cluster, rm_dir):
    cfg = cfg_of(
        reward_pretrain=rm_dir,
        actor_num_gpus_per_node=4,
        ref_num_gpus_per_node=2,
        critic_num_gpus_per_node=4,
        reward_num_gpus_per_node=4,
        colocate_critic_reward=True,
        vllm_tensor_parallel_size=2,
    )
    with placed(cfg) as r:
        assert sorted(assert_groups_whole(r).values()) == [4, 4, 4]
        crit, rew = r.role_bundles("critic"), r.role_bundles("reward")
        assert [b.bundle_index for b in rew] == [0, 1, 2, 3] and {b.share for b in crit + rew} == {0.5}
        assert rew[0].placement_group is crit[0].placement_group


@ray.remote
class Probe:
    def node(self):
        return ray.get_runtime_context().get_node_id()


def test_colocate_all_models_with_two_tp2_engines(cluster, rm_dir):
    shape = {f"{role}_num_gpus_per_node": 4 for role in ("actor", "ref", "critic", "reward")}
    cfg = cfg_of(
        reward_pretrain=rm_dir, colocate_all_models=True, vllm_num_engines=2, vllm_tensor_parallel_size=2, **shape
    )
    with placed(cfg) as r:
        (pg,) = r.groups.values()  # one pool, one node-group: everything on one node's 4 GPUs
        assert len(set(bundle_nodes(pg).values())) == 1
        e0, e1 = r.engine_bundles(0), r.engine_bundles(1)
        assert (e0.bundle_indices, e1.bundle_indices) == ([0, 1], [2, 3]) and e0.placement_group is pg
        # Five occupants of bundle 0 at 0.2 each must all be scheduled there (Ray's accounting sums to 1).
        on_bundle0 = [r.role_bundles(role)[0] for role in ("actor", "ref", "critic", "reward")]
        on_bundle0.append(P.RankBundle(e0.placement_group, e0.bundle_indices[0], e0.share))
        probes = [Probe.options(**P.scheduling_options(b, "cuda")).remote() for b in on_bundle0]
        try:
            nodes = ray.get([p.node.remote() for p in probes], timeout=60)
        finally:
            for p in probes:
                ray.kill(p)
        assert set(nodes) == set(bundle_nodes(pg).values())


def test_tp_engines_each_on_one_node(cluster):
    cfg = cfg_of(advantage_estimator="reinforce", vllm_num_engines=2, vllm_tensor_parallel_size=4)
    with placed(cfg) as r:
        engines = [bundle_nodes(r.engine_bundles(i).placement_group) for i in range(2)]
        assert all(len(m) == 4 and len(set(m.values())) == 1 for m in engines)
        assert set(engines[0].values()) != set(engines[1].values())  # 4 GPUs per node: one engine each


def test_cpu_slots(cluster):
    cfg = cfg_of(
        device="cpu",
        actor_num_nodes=2,
        actor_num_gpus_per_node=2,
        ref_num_gpus_per_node=2,
        critic_num_gpus_per_node=2,
        vllm_num_engines=2,
    )
    with placed(cfg, device="cpu") as r:
        assert_groups_whole(r)
        assert L.cpu_slots_needed(r.layout) == 4 + 2 + 2 + 2
        assert all(pg.bundle_specs == [{"CPU": 1.0}] * len(pg.bundle_specs) for pg in r.groups.values())


def test_unsatisfiable_fails_fast_with_the_table(cluster):
    layout = layout_of(
        cfg_of(actor_num_gpus_per_node=6, micro_train_batch_size=8, train_batch_size=48, rollout_batch_size=48), "cuda"
    )
    start = time.monotonic()
    with pytest.raises(L.PlacementError) as err:
        P.create_placement_groups(layout, timeout_s=600)
    assert time.monotonic() - start < 15  # a behaviour requirement: never the 600 s wait
    msg = str(err.value)
    assert "GPU need/free/total" in msg and "0/4/4" in msg and "actor g0: needs 6 GPU + 6 CPU on one node" in msg
    assert "--actor_num_gpus_per_node 6" in msg
    # The "a TP engine fits on one node" rule, which only the live cluster can check:
    with pytest.raises(L.PlacementError, match="lower --vllm_tensor_parallel_size to at most 4"):
        P.create_placement_groups(layout_of(cfg_of(vllm_tensor_parallel_size=8), "cuda"), timeout_s=600)
    assert time.monotonic() - start < 15
    assert live_groups() == 0


def test_busy_cluster_fails_after_settling_and_says_so(cluster):
    held = placement_group([{"GPU": 1, "CPU": 1}] * 4, strategy="STRICT_PACK")
    ray.get(held.ready(), timeout=30)
    try:
        layout = layout_of(
            cfg_of(
                actor_num_gpus_per_node=4,
                ref_num_gpus_per_node=4,
                critic_num_gpus_per_node=2,
                vllm_tensor_parallel_size=2,
            ),
            "cuda",
        )
        start = time.monotonic()
        with pytest.raises(L.PlacementError, match="only 8 are free now"):
            P.create_placement_groups(layout, timeout_s=600, settle_s=2)
        assert time.monotonic() - start < 15
    finally:
        remove_placement_group(held)


def test_not_ready_in_time_removes_what_it_created(cluster, monkeypatch):
    # A node that only the pre-flight believes in: the group passes the check, then never becomes ready.
    real = P.live_nodes
    monkeypatch.setattr(P, "live_nodes", lambda: real() + [L.NodeSpec("ghost", "-", 8, 8)])
    layout = layout_of(cfg_of(actor_num_gpus_per_node=8, micro_train_batch_size=8), "cuda")
    with pytest.raises(L.PlacementError, match=r"not ready after 2s: actor g0 \(8 x 1 GPU\+1 CPU\)"):
        P.create_placement_groups(layout, timeout_s=2)
    deadline = time.monotonic() + 10
    while live_groups() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_groups() == 0


def test_plan_against_the_live_cluster_creates_nothing(cluster, capsys):
    before = len(placement_group_table())
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--address", cluster.address, "--gpu_memory_gb", "80", "--vllm_num_engines", "2"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert "device cuda; cluster live Ray cluster" in out and "3 nodes" in out
    node_ids = {n["NodeID"][:8] for n in ray.nodes()}
    assert any(node_id in out for node_id in node_ids)
    assert len(placement_group_table()) == before


def test_a_restart_after_a_lost_node_waits_for_its_resources_then_names_what_is_missing(cluster):
    """The placement of a restart (launch/restart.py: --max_restarts after a lost node) waits up to its deadline for
    the lost resources to come back, where a first start fails at once; when they do not, the error is the table of
    what is missing. Last in the module: it removes a node (and adds one back)."""
    from concurrent.futures import ThreadPoolExecutor

    layout = layout_of(
        cfg_of(actor_num_gpus_per_node=4, ref_num_gpus_per_node=4, critic_num_gpus_per_node=2, vllm_num_engines=2),
        "cuda",
    )  # 12 GPUs: all three nodes
    cluster.remove_node(cluster.list_all_nodes()[-1])
    deadline = time.monotonic() + 30
    while sum(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]) > 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    start = time.monotonic()
    with pytest.raises(L.PlacementError, match=r"(?s)not placed:.*needs 12 GPUs in all, the cluster has 8"):
        P.create_placement_groups(layout, timeout_s=30, settle_s=2, wait_for_nodes=True)
    assert 2 <= time.monotonic() - start < 15  # waited for the node, then gave up with the table
    with ThreadPoolExecutor(1) as pool:  # the restart's placement waits while the node comes back
        waiting = pool.submit(P.create_placement_groups, layout, timeout_s=60, settle_s=60, wait_for_nodes=True)
        time.sleep(1.0)
        assert not waiting.done()
        cluster.add_node(**{k: v for k, v in NODE.items() if k != "include_dashboard"})
        result = waiting.result(timeout=90)
    try:
        assert len({result.node_of(key) for key in result.groups}) == 3
    finally:
        P.remove_placement_groups(result)
