"""Layout -> Ray: the live cluster's nodes, and one STRICT_PACK placement group per node-group of a layout.

    layout.plan_layout(cfg) --create_placement_groups(layout)-->
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

import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from orlhf.distributed.layout import GroupKey, Layout, NodeSpec, PlacementError, check_fits, fits_in_total, group_label

# ---- The live cluster --------------------------------------------------------------------------------------


def live_nodes(gpu_memory_gb: Optional[float] = None) -> list[NodeSpec]:
    """The alive nodes of the connected Ray cluster, with what is free on each now. Ray reports no GPU memory:
    pass it if known. Host memory is Ray's schedulable `memory` resource (a part of the RAM)."""
    import ray
    from ray._private import state  # DeveloperAPI; ray.nodes() only has totals

    free = state.available_resources_per_node()
    out = []
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        tot, now = n["Resources"], free.get(n["NodeID"], {})
        out.append(
            NodeSpec(
                n["NodeID"][:8],
                n["NodeManagerAddress"],
                now.get("GPU", 0.0),
                now.get("CPU", 0.0),
                gpu_memory_gb,
                tot.get("memory", 0.0) / 2**30,
                tot.get("GPU", 0.0),
                tot.get("CPU", 0.0),
                n["NodeID"],
            )
        )
    return out


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
    while True:
        nodes = live_nodes()
        try:
            return check_fits(layout, nodes), nodes
        except PlacementError:
            if not (wait_for_nodes or fits_in_total(layout, nodes)) or time.monotonic() > deadline:
                raise
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
