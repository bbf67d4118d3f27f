"""`orlhf plan`: where every role would run and how much memory each device needs, before anything starts.

    train-ppo flags -> TrainConfig -> cluster: live (--address) | described (--nodes N --gpus_per_node G)
                                             | this machine (neither): launch/plan_cluster.py
        -> plan_layout + simulate (distributed/placement.py) -> model sizes (config.json) -> memory per device
        -> text report; exit 0 when everything fits, 1 when a node-group cannot be placed or memory will not fit

The memory model (what each role holds per device, by ZeRO stage, and how occupants of one device add up) is
launch/plan_memory.py's.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

from orlhf.config.resolve import resolve_device
from orlhf.config.roles import ROLES
from orlhf.config.rollout_backends import ON_ACTOR, ON_ENGINES
from orlhf.config.train_config import TrainConfig
from orlhf.config.worker_config import zero_stage_of
from orlhf.distributed.layout import GroupKey, Layout, NodeSpec, Slot, fit_report, format_table, simulate
from orlhf.launch import plan_cpu
from orlhf.launch.bringup import run_layout
from orlhf.launch.plan_cluster import ClusterArgs, local_cpu_node, resolve_cluster
from orlhf.launch.plan_memory import (
    GIB,
    Memory,
    ModelDims,
    count_lora_params,
    count_params,
    device_peak,
    engine_memory,
    gib_text,
    role_dims,
    role_memory,
    trainer_generation_memory,
)

# ---- Report ------------------------------------------------------------------------------------------------


def run_plan(cfg: TrainConfig, args: ClusterArgs, nodes=None, where: Optional[str] = None) -> int:
    """Print the plan; 0 when it fits, 1 when something cannot be placed or will not fit. `nodes`, `where`: the
    cluster resolve_cluster found for `cfg` (the CLI resolves it before validating); looked up here when not given."""
    if where is None:
        device, nodes, where = resolve_cluster(cfg, args)
        cfg = resolve_device(cfg, device)  # the described / live cluster's device, not necessarily this machine's
    layout = run_layout(cfg)
    nodes = nodes if nodes is not None else [local_cpu_node(layout, args)]
    try:
        text, ok = render(cfg, layout, nodes, where)
    except ValueError as e:  # a model folder plan cannot size
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


def lora_line(cfg: TrainConfig, dims: dict[str, ModelDims]) -> list[str]:
    """With --lora_rank: what trains, and that no reference model is placed (its memory is saved)."""
    lo = cfg.lora
    if not lo.enabled:
        return []
    adapter = count_lora_params(dims["actor"], lo.lora_rank, lo.targets)
    ref = (
        "; no reference model (the actor's adapter-off forward scores it): "
        f"{_count(count_params(dims['actor']))} params not placed"
        if cfg.reference_from_actor
        else ""
    )
    return [f"LoRA rank {lo.lora_rank} on {lo.target_modules}: {_count(adapter)} params train{ref}"]


def render(cfg: TrainConfig, layout: Layout, nodes: list[NodeSpec], where: str) -> tuple[str, bool]:
    placed, unplaced = simulate(layout, nodes)
    dims = role_dims(cfg)
    lines = [
        f"orlhf plan: device {layout.device}; cluster {where}",
        f"model: {_count(count_params(dims['actor']))} params ({dims['actor'].source})",
        *lora_line(cfg, dims),
        "",
    ]
    lines += placement_section(layout, nodes, placed)
    problems = []
    if unplaced:
        problems.append(f"{len(unplaced)} node-group(s) cannot be placed")
        lines += ["", fit_report(layout, nodes, placed, unplaced)]
    mem_lines, mem_problems = memory_section(cfg, layout, nodes, placed, dims)
    lines += [""] + mem_lines
    problems += mem_problems
    lines.append("")
    lines.append(
        "DOES NOT FIT: " + "; ".join(problems) + "."
        if problems
        else "OK: every node-group is placed and every device's estimate is within its memory."
    )
    return "\n".join(lines), not problems


def _count(n: int) -> str:
    return next(f"{n / d:.3g}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= d or d == 1)


_gib = gib_text


def placement_section(layout: Layout, nodes: list[NodeSpec], placed: dict[GroupKey, int]) -> list[str]:
    rows = []
    for role, slots in layout.roles.items():
        pool = layout.pool(slots[0].pool)
        rows += _placement_rows(role, f"{len(slots)} ({pool.num_groups}x{pool.group_size})", slots, nodes, placed)
    for i, slots in enumerate(layout.engines):
        rows += _placement_rows(f"{layout.engine}{i}", f"TP {len(slots)}", slots, nodes, placed)
    head = ["who", "ranks", "pool", "node-group", "node", "bundles", "share"]
    notes = [
        f"{guest} runs inside the {host}'s rank processes (rank k in {host} rank k's): no bundles or process "
        f"of its own (--{guest}_own_process gives it its own)"
        for guest, host in layout.guests.items()
    ]
    return [
        "placement (predicted by first-fit; live placement groups are hinted to these nodes):",
        format_table(head, rows),
        *notes,
    ]


def _placement_rows(
    who: str, ranks: str, slots: tuple[Slot, ...], nodes: list[NodeSpec], placed: dict[GroupKey, int]
) -> list[list[str]]:
    by_group: dict[GroupKey, list[int]] = {}
    for s in slots:
        by_group.setdefault((s.pool, s.group), []).append(s.bundle)
    rows = []
    for j, (key, bundles) in enumerate(by_group.items()):
        node = nodes[placed[key]] if key in placed else None
        where = "NOT PLACED" if node is None else node.name + ("" if node.ip == "-" else f" ({node.ip})")
        span = f"{bundles[0]}-{bundles[-1]}" if len(bundles) > 1 else str(bundles[0])
        rows.append(
            [who if j == 0 else "", ranks if j == 0 else "", key[0], f"g{key[1]}", where, span, f"{slots[0].share:g}"]
        )
    return rows


def memory_section(
    cfg: TrainConfig, layout: Layout, nodes: list[NodeSpec], placed: dict[GroupKey, int], dims: dict[str, ModelDims]
) -> tuple[list[str], list[str]]:
    """The per-rank estimate, the per-device sums (cuda) and the per-node host sums; and what does not fit."""
    lo = cfg.lora

    def adapter(role: str) -> int:
        return count_lora_params(dims[role], lo.lora_rank, lo.targets) if lo.enabled and ROLES[role].trains else 0

    mems = {
        role: role_memory(
            cfg,
            role,
            count_params(dims[role], value_head=ROLES[role].value_head),
            len(slots),
            device=layout.device,
            adapter=adapter(role),
        )
        for role, slots in layout.roles.items()
    }
    known = [n.gpu_memory_gb for n in nodes if n.gpu_memory_gb]
    per = "GPU GiB/rank" if layout.device == "cuda" else "GiB/rank"
    rows = [[m.who, _count(m.params), m.ranks, _gib(m.device_gib), _gib(m.host_gib), m.formula] for m in mems.values()]
    eng = generation_memory(cfg, layout, dims["actor"], min(known) if known else None)
    if eng is not None:
        ranks = f"TP {eng.ranks}" if cfg.rollout.memory == ON_ENGINES else eng.ranks
        rows.append(
            [_generation_who(cfg), _count(eng.params), ranks, _gib(eng.device_gib), _gib(eng.host_gib), eng.formula]
        )
    cpu = layout.device == "cpu"
    held = "model states; each process's total below" if cpu else "model states and DeepSpeed's reduce bucket"
    on_top = "" if cpu else "activations come on top; "
    stages = ", ".join(
        f"{role} {zero_stage_of(cfg, role, len(slots), layout.device)}" for role, slots in layout.roles.items()
    )
    lines = [
        f"memory estimate ({held}; {on_top}"
        f"{'bf16' if cfg.deepspeed.bf16 else 'fp32'}, ZeRO stage: {stages}; P = params):",
        format_table(["who", "params", "ranks", per, "host GiB/rank", "formula"], rows),
    ]
    problems: list[str] = []
    if layout.device == "cuda":
        lines += ["", *_device_sums(cfg, layout, nodes, placed, mems, eng, dims["actor"], problems)]
    if cpu:
        procs = plan_cpu.processes(cfg, layout, mems, dims, eng if cfg.rollout.memory == ON_ACTOR else None)
        lines += ["", *plan_cpu.process_lines(procs)]
        needs = plan_cpu.host_needs(procs, nodes, placed)
    else:
        needs = [_host_need(cfg, layout, placed, mems, eng, i) for i in range(len(nodes))]
    lines += ["", *_host_sums(layout, nodes, needs, problems)]
    return lines, problems


def generation_memory(cfg: TrainConfig, layout: Layout, actor: ModelDims, gpu_gib: Optional[float]) -> Optional[Memory]:
    """What generating takes, where the backend's record says it lives (config/rollout_backends.py): on each of its
    engines, on top of each actor rank's states, or nowhere in this cluster (None)."""
    if cfg.rollout.memory == ON_ACTOR:
        stage = zero_stage_of(cfg, "actor", len(layout.roles["actor"]), layout.device)
        return trainer_generation_memory(cfg, actor, len(layout.roles["actor"]), stage)
    if cfg.rollout.memory == ON_ENGINES:
        return engine_memory(cfg, actor, layout.device, gpu_gib)
    return None


def _generation_who(cfg: TrainConfig) -> str:
    return "generate (actor)" if cfg.rollout.memory == ON_ACTOR else f"{cfg.rollout.engine} (each)"


def _generates(cfg: TrainConfig, layout: Layout, occupants: tuple[str, ...]) -> bool:
    """A pool whose occupants hold the backend's generation memory."""
    if cfg.rollout.memory == ON_ACTOR:
        return "actor" in occupants
    return layout.engine is not None and any(o.startswith(layout.engine) for o in occupants)


def _pool_load(
    cfg: TrainConfig,
    layout: Layout,
    occupants: tuple[str, ...],
    mems: dict[str, Memory],
    eng: Optional[Memory],
    attr: str,
) -> float:
    trainers = sum(getattr(mems[r], attr) for r in occupants if r in mems)
    engine = getattr(eng, attr) if eng is not None and _generates(cfg, layout, occupants) else 0.0
    return device_peak(cfg, trainers, engine) if attr == "device_gib" else trainers + engine


def _device_sums(
    cfg: TrainConfig,
    layout: Layout,
    nodes: list[NodeSpec],
    placed: dict[GroupKey, int],
    mems: dict[str, Memory],
    eng: Optional[Memory],
    actor_dims: ModelDims,
    problems: list[str],
) -> list[str]:
    rows = []
    for pool in layout.pools:
        caps = [nodes[placed[(pool.name, g)]].gpu_memory_gb for g in range(pool.num_groups) if (pool.name, g) in placed]
        caps = [c for c in caps if c] or [n.gpu_memory_gb for n in nodes if n.gpu_memory_gb]
        cap = min(caps) if caps else None
        need = _pool_load(cfg, layout, pool.occupants, mems, eng, "device_gib")
        status = (
            "?"
            if cap is None or math.isnan(need)
            else "ok"
            if need <= 0.9 * cap
            else "tight"
            if need <= cap
            else "NOT FIT"
        )
        if status == "NOT FIT":
            problems.append(f"{pool.name} needs {need:.1f} GiB per GPU, more than {cap:g}")
        rows.append([pool.name, _gib(need), "?" if cap is None else f"{cap:g}", status])
    on_engines = cfg.rollout.memory == ON_ENGINES
    weights = actor_dims.dtype_bytes * eng.params / eng.ranks / GIB if on_engines else 0.0
    if on_engines and weights > eng.device_gib:  # NaN (unknown GPU memory) compares False: no claim
        problems.append(
            f"vLLM weights take {weights:.1f} GiB per GPU, more than its {eng.device_gib:.1f} GiB budget: "
            "raise --vllm_tensor_parallel_size or --vllm_gpu_memory_utilization"
        )
    note = "" if any(n.gpu_memory_gb for n in nodes) else " (GPU memory unknown: pass --gpu_memory_gb)"
    return [
        f"per GPU (occupants of one GPU add up; sleep flags take the larger phase){note}:",
        format_table(["pool", "GiB needed", "GiB per GPU", "status"], rows),
    ]


def _host_need(
    cfg: TrainConfig,
    layout: Layout,
    placed: dict[GroupKey, int],
    mems: dict[str, Memory],
    eng: Optional[Memory],
    i: int,
) -> float:
    """GiB of host memory node i needs on cuda: the offloaded states of the ranks placed there."""
    return sum(
        layout.pool(k[0]).group_size * _pool_load(cfg, layout, layout.pool(k[0]).occupants, mems, eng, "host_gib")
        for k, n in placed.items()
        if n == i
    )


def _host_sums(layout: Layout, nodes: list[NodeSpec], needs: list[float], problems: list[str]) -> list[str]:
    rows, total = [], 0.0
    for node, need in zip(nodes, needs):
        total += need
        cap = node.host_memory_gb
        status = "?" if cap is None else "ok" if need <= 0.9 * cap else "tight" if need <= cap else "NOT FIT"
        if status == "NOT FIT":
            problems.append(f"node {node.name} needs {need:.1f} GiB of host memory, more than {cap:.1f}")
        rows.append([node.name, _gib(need), "?" if cap is None else f"{cap:.1f}", status])
    if not any(n.host_memory_gb for n in nodes):
        return [f"host memory: {_gib(total)} GiB in all across nodes; not checked (pass --host_memory_gb)."]
    return [
        "host memory per node (" + ("every process above" if layout.device == "cpu" else "offloaded states") + "):",
        format_table(["node", "GiB needed", "GiB on node", "status"], rows),
    ]
