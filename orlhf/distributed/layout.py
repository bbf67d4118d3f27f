"""Flags -> layout: which device slot every rank and every rollout engine takes, and whether it fits. Pure: no Ray.

    TrainConfig, guests --plan_layout()--> Layout: pools of node-groups, one Slot per rank (pure data)
        --check_fits(layout, nodes)--> {node-group -> node}, or PlacementError with a needed-vs-available table
           (first-fit-decreasing bin packing, simulate; fit_report writes the table and the fix)
    distributed/placement.py then makes it real on a live Ray cluster (placement groups, bundles for the rank actors);
    `orlhf plan` (launch/plan.py) prints the same layout with memory estimates, on a described or live cluster.

Words. A *slot* is one device: one GPU on cuda (bundle {"GPU": 1, "CPU": 1}); on cpu one rank (bundle
{"CPU": 1}), because there the "GPU" flags count ranks. A *node-group* is `num_gpus_per_node` slots that must sit on
one node: one placement group with STRICT_PACK. A *pool* is `num_nodes` node-groups. Rank r of a role uses
node-group r // num_gpus_per_node, bundle r % num_gpus_per_node.

Pools. Split placement gives each role (config/roles.py) its own pool and each rollout engine its own 1 x TP pool
(an engine's TP ranks share one node; the rollout backend's record names its engines: config/rollout_backends.py,
"vllm"; a backend that places none adds no pool). --colocate_actor_ref and --colocate_critic_reward merge two roles
into one pool (RoleSpec.colocate_with); --colocate_all_models puts every model and the engines on the actor's pool,
engine i on its slots [i*TP, (i+1)*TP), which never straddle node-groups because validation makes TP divide the
actor's GPUs per node.

Shares (the rule): the k occupants of a slot each ask Ray for 1/k of it, rounded down to 1/100 so the sum
stays <= 1 (actor+ref: 0.5 each; four models + vLLM: 0.2 each). A share is Ray accounting, not a memory split:
memory on a shared device is governed by the offload/sleep flags, and `orlhf plan` estimates it.

Guests. A role that runs inside another role's rank processes (the platform's Tuning.guests: on CPU the reference
in the actor's, cpu/hosting_rules.py) joins its host's pool, takes its host's slots and no share of its own: it has
no process, so no bundle (on CPU a bundle is one logical CPU, Ray accounting only). Layout.guests records it for
`orlhf plan`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from orlhf.config.roles import ROLES, active_roles
from orlhf.config.train_config import TrainConfig

LOCAL_SPARE_CPUS = 2  # logical CPUs beyond the slots for a local CPU cluster: driver-side actors, head work
GroupKey = tuple[str, int]  # (pool name, node-group index)


class PlacementError(RuntimeError):
    """The layout cannot be placed (or was not placed in time); the message carries the table and the fix."""


# ---- The layout: pure data --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    name: str  # occupants joined by "+": "actor", "actor+ref", "actor+ref+critic+vllm"; "vllm0" for engine 0
    num_groups: int  # node-groups, one placement group each (--<role>_num_nodes; 1 for an engine pool)
    group_size: int  # slots per node-group (--<role>_num_gpus_per_node; TP for an engine pool)
    flag: str  # the flag that sets group_size, named in errors
    nodes_flag: Optional[str]  # the flag that sets num_groups (None for an engine pool)

    @property
    def num_slots(self) -> int:
        return self.num_groups * self.group_size

    @property
    def occupants(self) -> tuple[str, ...]:
        return tuple(self.name.split("+"))


@dataclass(frozen=True)
class Slot:
    pool: str  # Pool.name
    group: int  # node-group index in the pool
    bundle: int  # bundle index inside that node-group's placement group
    share: float  # of the slot's device this rank asks Ray for (1.0 alone, 1/k among k occupants)


@dataclass(frozen=True)
class Layout:
    device: str  # "cuda" | "cpu"
    pools: tuple[Pool, ...]
    roles: dict[str, tuple[Slot, ...]]  # role -> one Slot per rank, rank order (read-only by convention)
    engines: tuple[tuple[Slot, ...], ...]  # engine i -> its TP slots, TP-rank order
    guests: dict[str, str] = field(default_factory=dict)  # role -> the role whose processes run it (no bundles)
    engine: Optional[str] = None  # the rollout backend's name for its engines (BackendSpec.engine); None: places none

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    @property
    def bundle(self) -> dict[str, float]:
        """Resources of one slot."""
        return {"GPU": 1.0, "CPU": 1.0} if self.device == "cuda" else {"CPU": 1.0}

    def group_need(self, pool: Pool) -> dict[str, float]:
        """Resources one node-group of `pool` needs on a single node."""
        return {k: v * pool.group_size for k, v in self.bundle.items()}

    def group_keys(self) -> list[GroupKey]:
        return [(p.name, g) for p in self.pools for g in range(p.num_groups)]


def _pool_members(cfg: TrainConfig, roles: list[str], guests: dict[str, str]) -> list[list[str]]:
    """Occupants of each model pool, lead role first (the lead's flags give the pool's shape)."""
    p = cfg.placement
    if p.colocate_all_models:
        return [roles + ([cfg.rollout.engine] if cfg.engines_colocated else [])]
    host = {
        name: spec.colocate_with
        for name, spec in ROLES.items()
        if spec.colocate_flag is not None and getattr(p, spec.colocate_flag)
    }
    host.update(guests)  # guests join their host
    pools: list[list[str]] = []
    for role in roles:
        shared = next((m for m in pools if host.get(role) in m), None)
        if shared is not None:
            shared.append(role)
        else:
            pools.append([role])
    return pools


def _share(occupants: int) -> float:
    return math.floor(100 / occupants) / 100


def _slots(pool: Pool, slot_ids: range, share: float) -> tuple[Slot, ...]:
    return tuple(Slot(pool.name, s // pool.group_size, s % pool.group_size, share) for s in slot_ids)


def plan_layout(cfg: TrainConfig, guests: dict[str, str]) -> Layout:
    """Pools and slots for `cfg` on its device (TrainConfig.device: "cuda" or "cpu", resolved), `guests` ({role: host
    role}) inside their hosts' processes: the platform's Tuning.guests(cfg). Pure: no Ray."""
    device = cfg.device  # ValueError while still "auto"
    p, tp = cfg.placement, cfg.vllm.tensor_parallel_size
    pools: list[Pool] = []
    roles: dict[str, tuple[Slot, ...]] = {}
    guests = dict(guests)
    for members in _pool_members(cfg, active_roles(cfg), guests):
        lead = members[0]
        pool = Pool(
            "+".join(members),
            getattr(p, f"{lead}_num_nodes"),
            getattr(p, f"{lead}_num_gpus_per_node"),
            f"--{lead}_num_gpus_per_node",
            f"--{lead}_num_nodes",
        )
        pools.append(pool)
        processes = [m for m in members if m not in guests]  # a guest asks for no share: it has no process
        for role in processes:
            if role != cfg.rollout.engine:
                roles[role] = _slots(pool, range(pool.num_slots), _share(len(processes)))
        for role in members:
            if role in guests:
                roles[role] = roles[guests[role]]
    if cfg.engines_colocated:
        shared = pools[0]
        sharing = [o for o in shared.occupants if o not in guests]
        engines = tuple(
            _slots(shared, range(i * tp, (i + 1) * tp), _share(len(sharing))) for i in range(cfg.num_engines)
        )
    else:
        engine_pools = [
            Pool(f"{cfg.rollout.engine}{i}", 1, tp, "--vllm_tensor_parallel_size", None) for i in range(cfg.num_engines)
        ]
        pools.extend(engine_pools)
        engines = tuple(_slots(ep, range(tp), 1.0) for ep in engine_pools)
    return Layout(device, tuple(pools), roles, engines, guests, cfg.rollout.engine)


def cpu_slots_needed(layout: Layout) -> int:
    """Logical CPUs the layout's bundles take. A local CPU cluster must advertise at least this many
    (plus spare, see local_num_cpus): logical CPUs are Ray accounting, not cores."""
    return int(sum(layout.bundle["CPU"] * p.num_slots for p in layout.pools))


def local_num_cpus(layout: Layout) -> int:
    """`num_cpus` for the local Ray cluster orlhf starts itself on CPU."""
    return max(cpu_slots_needed(layout) + LOCAL_SPARE_CPUS, os.cpu_count() or 1)


# ---- Pre-flight: does every node-group fit on some node? -------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    name: str  # short Ray node id on a live cluster; "node0", ... for a described one
    ip: str
    gpus: float  # free now (live cluster) or all of them (described)
    cpus: float  # math.inf: not modelled (a described GPU cluster)
    gpu_memory_gb: Optional[float] = None  # GiB per GPU; Ray does not report it
    host_memory_gb: Optional[float] = None  # GiB
    total_gpus: Optional[float] = None  # None: same as gpus
    total_cpus: Optional[float] = None
    node_id: str = ""  # Ray's hex id ("" when described): the soft target of the node's placement groups

    def capacity(self, total: bool = False) -> dict[str, float]:
        if total:
            return {"GPU": _or(self.total_gpus, self.gpus), "CPU": _or(self.total_cpus, self.cpus)}
        return {"GPU": self.gpus, "CPU": self.cpus}


def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


def simulate(layout: Layout, nodes: list[NodeSpec], total: bool = False) -> tuple[dict[GroupKey, int], list[GroupKey]]:
    """First-fit decreasing: node-groups largest first, each on the first node with room for all its bundles
    (STRICT_PACK). Returns ({group -> node index}, groups that found no node), in placement order. A heuristic
    (bin packing is NP-hard), exact for the usual shapes: node-groups that divide the nodes."""
    free = [n.capacity(total) for n in nodes]
    placed: dict[GroupKey, int] = {}
    unplaced: list[GroupKey] = []
    for key in sorted(layout.group_keys(), key=lambda k: -layout.pool(k[0]).group_size):
        need = layout.group_need(layout.pool(key[0]))
        node = next((i for i, f in enumerate(free) if all(f.get(r, 0) >= q - 1e-9 for r, q in need.items())), None)
        if node is None:
            unplaced.append(key)
            continue
        placed[key] = node
        for r, q in need.items():
            free[node][r] -= q
    return placed, unplaced


def check_fits(layout: Layout, nodes: list[NodeSpec]) -> dict[GroupKey, int]:
    """{node-group -> node index} for a placement of every node-group on `nodes`' free resources, or
    PlacementError naming what does not fit, the per-node table, and the fix."""
    placed, unplaced = simulate(layout, nodes)
    if unplaced:
        raise PlacementError(fit_report(layout, nodes, placed, unplaced))
    return placed


def fits_in_total(layout: Layout, nodes: list[NodeSpec]) -> bool:
    """Would the layout fit if nothing else held resources? (False: waiting cannot help.)"""
    return not simulate(layout, nodes, total=True)[1]


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _num(x: float) -> str:
    return "-" if math.isinf(x) else f"{x:g}"


def group_label(key: GroupKey) -> str:
    return f"{key[0]} g{key[1]}"


def fit_report(layout: Layout, nodes: list[NodeSpec], placed: dict[GroupKey, int], unplaced: list[GroupKey]) -> str:
    """The needed-vs-available table: per node what the placed node-groups take of what is free (and in all),
    then the node-groups that found no node, then the fix."""
    unit = "GPU" if layout.device == "cuda" else "CPU"
    rows = []
    for i, n in enumerate(nodes):
        mine = [k for k, node in placed.items() if node == i]
        need = {r: sum(layout.group_need(layout.pool(k[0])).get(r, 0) for k in mine) for r in ("GPU", "CPU")}
        tot = n.capacity(total=True)
        rows.append(
            [
                n.name + ("" if n.ip == "-" else f" ({n.ip})"),
                f"{_num(need['GPU'])}/{_num(n.gpus)}/{_num(tot['GPU'])}",
                f"{_num(need['CPU'])}/{_num(n.cpus)}/{_num(tot['CPU'])}",
                ", ".join(f"{group_label(k)} ({layout.pool(k[0]).group_size})" for k in mine) or "-",
            ]
        )
    bundle = " + ".join(f"{v:g} {k}" for k, v in layout.bundle.items())
    lines = [
        f"placement does not fit: {len(unplaced)} of {len(layout.group_keys())} node-group(s) found no node "
        f"(device {layout.device}; one slot = {bundle}; a node-group's slots must share one node)",
        format_table(["node", "GPU need/free/total", "CPU need/free/total", "node-groups placed (slots)"], rows),
        "not placed:",
    ]
    for k in unplaced:
        need = layout.group_need(layout.pool(k[0]))
        lines.append(f"  {group_label(k)}: needs {' + '.join(f'{v:g} {r}' for r, v in need.items())} on one node")
    lines.append("fix:")
    lines += [f"  - {f}" for f in _fixes(layout, nodes, unplaced, unit)]
    return "\n".join(lines)


def _fixes(layout: Layout, nodes: list[NodeSpec], unplaced: list[GroupKey], unit: str) -> list[str]:
    largest = max((n.capacity(total=True)[unit] for n in nodes), default=0)
    out = []
    for pool in {layout.pool(k[0]).name: layout.pool(k[0]) for k in unplaced}.values():
        if pool.group_size <= largest:
            continue
        if pool.nodes_flag is None:
            out.append(
                f"{pool.flag} {pool.group_size}: one engine needs {pool.group_size} {unit}s on one node, but "
                f"the largest node has {largest:g}: lower --vllm_tensor_parallel_size to at most {largest:g}."
            )
        else:
            out.append(
                f"{pool.flag} {pool.group_size} ({pool.name}): more {unit}s per node than the largest node "
                f"has ({largest:g}): use at most {largest:g} per node and raise {pool.nodes_flag} to keep the total."
            )
    need = sum(layout.bundle[unit] * p.num_slots for p in layout.pools)
    total = sum(n.capacity(total=True)[unit] for n in nodes)
    free = sum(n.capacity()[unit] for n in nodes)
    if need > total:
        out.append(
            f"the layout needs {need:g} {unit}s in all, the cluster has {total:g}: add nodes, or use fewer "
            "ranks/engines, or share devices (--colocate_actor_ref, --colocate_critic_reward, "
            "--colocate_all_models)."
        )
    elif fits_in_total(layout, nodes):
        out.append(
            f"it fits the cluster's {total:g} {unit}s, but only {free:g} are free now: other jobs or placement "
            "groups hold the rest (see `ray status`); wait for them or free them."
        )
    elif not out:
        out.append(
            f"{need:g} {unit}s are enough in total but not node by node: choose per-node counts that fill "
            f"nodes (divisors of {largest:g}), or add nodes."
        )
    return out


def described_nodes(
    num_nodes: int,
    gpus_per_node: int,
    device: str,
    gpu_memory_gb: Optional[float] = None,
    host_memory_gb: Optional[float] = None,
) -> list[NodeSpec]:
    """A cluster described by its shape. On cpu, gpus_per_node counts CPU slots; on cuda CPUs are not modelled."""
    cpus = float(gpus_per_node) if device == "cpu" else math.inf
    gpus = 0.0 if device == "cpu" else float(gpus_per_node)
    return [NodeSpec(f"node{i}", "-", gpus, cpus, gpu_memory_gb, host_memory_gb) for i in range(num_nodes)]
