"""Layout -> Ray: the live cluster's nodes, and one STRICT_PACK placement group per node-group of a layout.

    layout.plan_layout(cfg, guests) --create_placement_groups(layout)-->
        live_nodes() -> layout.check_fits (re-read for settle_s while freed resources show up)
        -> one placement group per node-group, hinted to the node the simulation chose, all ready within timeout_s
        -> PlacedLayout: role_bundles(role) / engine_bundles(i) -> (placement group, bundle index, share)
           scheduling_options(bundle) -> the `.options(...)` of a rank actor (distributed/groups.py, rollout/engine.py)
    remove_placement_groups(placed) at the end of the run.

Invariants: nothing is created until check_fits passes on the live cluster's free resources (an unsatisfiable
placement group would wait forever); every wait has a timeout; on any failure, groups created so far are removed.
Ray is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from orlhf.distributed.layout import GroupKey, Layout, NodeSpec, PlacementError, check_fits, fits_in_total, group_label
from orlhf.storage.logs import EVERY_TIME

# ---- The live cluster --------------------------------------------------------------------------------------


def live_nodes(gpu_memory_gb: Optional[float] = None, read_gpu_memory: bool = False) -> list[NodeSpec]:
    """The alive nodes of the connected Ray cluster, with what is free on each now. Ray reports no GPU memory: it is
    `gpu_memory_gb` when given, else with `read_gpu_memory` what nvidia-smi reports on each GPU node
    (gpu_memory_per_node: a task per node, so only `orlhf plan` asks), else None (unknown). Host memory is Ray's
    schedulable `memory` resource (a part of the RAM)."""
    import ray
    from ray._private import state  # DeveloperAPI; ray.nodes() only has totals

    free = state.available_resources_per_node()
    alive = [n for n in ray.nodes() if n["Alive"]]
    measured: dict[str, float] = {}
    if gpu_memory_gb is None and read_gpu_memory:
        measured = gpu_memory_per_node([n["NodeID"] for n in alive if n["Resources"].get("GPU", 0.0) > 0])
    out = []
    for n in alive:
        tot, now = n["Resources"], free.get(n["NodeID"], {})
        out.append(
            NodeSpec(
                n["NodeID"][:8],
                n["NodeManagerAddress"],
                now.get("GPU", 0.0),
                now.get("CPU", 0.0),
                gpu_memory_gb if gpu_memory_gb is not None else measured.get(n["NodeID"]),
                tot.get("memory", 0.0) / 2**30,
                tot.get("GPU", 0.0),
                tot.get("CPU", 0.0),
                n["NodeID"],
            )
        )
    return out


GPU_MEMORY_QUERY = ("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits")  # MiB, one line a GPU


def gpu_memory_per_node(node_ids: list[str], timeout_s: float = 15.0) -> dict[str, float]:
    """GiB of the smallest GPU on each of `node_ids`, from GPU_MEMORY_QUERY run on the node by a task pinned there.
    nvidia-smi lists every GPU of the node whatever CUDA_VISIBLE_DEVICES says, so the task asks for no GPU (and no
    CPU): it runs on a node whose GPUs are all taken too. A node where it fails (no nvidia-smi, a ROCm node, no answer
    within `timeout_s`) is left out: its GPU memory stays unknown."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def query(command: tuple[str, ...]) -> Optional[str]:  # nested: pickled by value, nodes need no orlhf for it
        import subprocess

        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=5, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    if not node_ids:
        return {}
    task = ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(query)
    refs = {
        node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            GPU_MEMORY_QUERY
        )
        for node in node_ids
    }
    ready, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        ray.cancel(ref, force=True)
    out = {}
    for node, ref in refs.items():
        try:
            gib = smallest_gpu_gib(ray.get(ref)) if ref in ready else None
        except ray.exceptions.RayError:  # the node went away meanwhile
            gib = None
        if gib is not None:
            out[node] = gib
    return out


def smallest_gpu_gib(memory_total: Optional[str]) -> Optional[float]:
    """GPU_MEMORY_QUERY's output (MiB, one line a GPU) -> the smallest GPU in GiB, rounded down to 0.1 so that plan
    never claims more than there is; None when it holds no figure ("[N/A]", nothing)."""
    mib = []
    for line in (memory_total or "").splitlines():
        try:
            mib.append(float(line.strip()))
        except ValueError:
            continue
    mib = [m for m in mib if m > 0]
    return math.floor(min(mib) / 1024 * 10) / 10 if mib else None


class RankBundle(NamedTuple):
    placement_group: Any  # ray.util.placement_group.PlacementGroup
    bundle_index: int
    share: float  # num_gpus (cuda) and num_cpus to ask for on that bundle


class EngineBundles(NamedTuple):
    placement_group: Any
    bundle_indices: list[int]  # one per TP rank
    share: float


@dataclass(frozen=True)
class PlacedLayout:
    layout: Layout
    groups: dict[GroupKey, Any]  # (pool, node-group) -> its ready STRICT_PACK placement group

    def role_bundles(self, role: str) -> list[RankBundle]:
        """One entry per rank of `role`, rank order."""
        return [RankBundle(self.groups[(s.pool, s.group)], s.bundle, s.share) for s in self.layout.roles[role]]

    def engine_bundles(self, engine: int) -> EngineBundles:
        slots = self.layout.engines[engine]
        return EngineBundles(self.groups[(slots[0].pool, slots[0].group)], [s.bundle for s in slots], slots[0].share)

    def node_of(self, key: GroupKey) -> str:
        """Ray node id the node-group landed on."""
        from ray.util import placement_group_table

        return placement_group_table(self.groups[key])["bundles_to_node_id"][0]


def scheduling_options(rb: RankBundle, device: str) -> dict[str, Any]:
    """`.options(**...)` for a rank actor on its bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {
        "num_cpus": rb.share,
        "num_gpus": rb.share if device == "cuda" else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(rb.placement_group, rb.bundle_index),
    }


def create_placement_groups(
    layout: Layout, timeout_s: float, settle_s: float = 5.0, wait_for_nodes: bool = False
) -> PlacedLayout:
    """Pre-flight on the live cluster, then one STRICT_PACK placement group per node-group, ready within
    timeout_s. When the layout fits the cluster's total but not what is free, the free view is re-read for up to
    settle_s (resources just released take a moment to show) before PlacementError. `wait_for_nodes`: also when it
    does not fit the total (a restart after a lost node: the node, or another, may join within settle_s); the
    PlacementError then shows the per-node table of what is missing."""
    from ray.util.placement_group import placement_group

    placed, nodes = _wait_for_fit(layout, settle_s, wait_for_nodes)
    token = uuid.uuid4().hex[:6]  # placement group names must be unique in the cluster
    groups: dict[GroupKey, Any] = {}
    try:
        for key, node in placed.items():  # largest first, as simulated, each hinted to its simulated node
            groups[key] = placement_group(
                [layout.bundle] * layout.pool(key[0]).group_size,
                strategy="STRICT_PACK",
                name=f"orlhf-{token}-{key[0]}-g{key[1]}",
                _soft_target_node_id=nodes[node].node_id or None,
            )
        _wait_ready(groups, timeout_s)
    except BaseException:
        _remove(groups.values())
        raise
    return PlacedLayout(layout, {k: groups[k] for k in layout.group_keys()})


def _wait_for_fit(
    layout: Layout, settle_s: float, wait_for_nodes: bool = False
) -> tuple[dict[GroupKey, int], list[NodeSpec]]:
    deadline = time.monotonic() + settle_s
    said = False
    while True:
        nodes = live_nodes()
        try:
            return check_fits(layout, nodes), nodes
        except PlacementError:
            short = not fits_in_total(layout, nodes)  # not even on an empty cluster: a node is missing
            if (short and not wait_for_nodes) or time.monotonic() > deadline:
                raise
            if short and not said:  # a restart after a lost node: say what the run is waiting for
                logging.getLogger("orlhf").warning(
                    "the cluster has no room for the run's groups now (%d live node(s)): waiting up to %.0f s for a "
                    "node to join (--ray_timeout_s)",
                    len(nodes),
                    settle_s,
                    extra=EVERY_TIME,  # each restart's wait is shown, not the first only
                )
                said = True
            time.sleep(0.5)


def _wait_ready(groups: dict[GroupKey, Any], timeout_s: float) -> None:
    import ray

    refs = {g.ready(): k for k, g in groups.items()}
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        waited = ", ".join(f"{group_label(refs[r])} ({_bundle_text(groups[refs[r]])})" for r in pending)
        raise PlacementError(
            f"placement groups not ready after {timeout_s:g}s: {waited}. Ray waits forever for "
            "resources that never free up; see `ray status` for who holds them."
        )


def wait_placed(pg: Any, timeout_s: float) -> None:
    """Wait until placement group `pg` is placed (Ray moves a lost node's bundles to a node with room, once it has
    noticed the loss); PlacementError after timeout_s."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while placement_group_table(pg).get("state") != "CREATED":
        if time.monotonic() > deadline:
            raise PlacementError(
                f"placement group {placement_group_table(pg).get('name')} not placed again within {timeout_s:g} s "
                "after a lost node; see `ray status` for the cluster's nodes"
            )
        time.sleep(0.5)


def _bundle_text(pg: Any) -> str:
    specs = pg.bundle_specs
    return f"{len(specs)} x " + "+".join(f"{v:g} {k}" for k, v in specs[0].items())


def _remove(pgs: Any, timeout_s: float = 10.0) -> None:
    """Remove and wait until Ray says REMOVED, so the next pre-flight sees the resources back."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    pgs = list(pgs)
    for pg in pgs:
        remove_placement_group(pg)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(placement_group_table(pg)["state"] != "REMOVED" for pg in pgs):
        time.sleep(0.05)


def remove_placement_groups(placed: PlacedLayout) -> None:
    _remove(placed.groups.values())
