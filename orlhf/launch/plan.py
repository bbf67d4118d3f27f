"""`orlhf plan`: where every role would run and how much memory each device needs, before anything starts.

    train-ppo flags -> TrainConfig -> cluster: live (--address: reads ray.nodes(); starts no model, creates no
                                                      placement group)
                                             | described (--nodes N --gpus_per_node G [--gpu_memory_gb M])
                                             | this machine (neither)
        -> plan_layout + simulate (distributed/placement.py) -> model sizes (config.json) -> memory per device
        -> text report; exit 0 when everything fits, 1 when a node-group cannot be placed or memory will not fit

Memory model (GiB = 2**30 bytes). Model states, plus on GPUs DeepSpeed's reduce bucket under ZeRO-1/2/3 (5e8
gradient elements, allocated whole per trained rank: + 2 x 5e8 B in bf16, fp32 under ZeRO-1); activations and gathered
ZeRO-3 layers come on
top, so keep headroom ("tight" marks > 90%).
  P = parameters, counted from config.json (dense Llama-style: embeddings, attention with grouped KV heads,
      gated MLP, norms; biases ignored). Critic and reward: no LM head, a value head (hidden x 1).
  w = bytes per weight: 2 with --bf16, else 4; gradients the same. K = Adam states: 12 with --bf16 (fp32 master
      + m + v), 8 in fp32 (the weights are the master: m + v).
  trained (actor, critic) on N ranks, by ZeRO stage (ZeRO paper / DeepSpeed docs):
      0: (w + w + K)P    1: (w + w)P + KP/N    2: wP + (w + K)P/N    3: (w + w + K)P/N
      --adam_offload moves the K part to host memory.
  frozen (ref, reward): wP/N at stage 3, wP otherwise; --ref_reward_offload moves it to host memory.
  vLLM engine: vllm_gpu_memory_utilization x GPU memory, on each of its TP GPUs; its weights (2P/TP) must fit
      inside that, the rest is KV cache. On cpu: weights + $VLLM_CPU_KVCACHE_SPACE GiB (1 if unset).
  Occupants of one device add up. With an engine there, the peak is the larger of generation (engine, plus the
  trainers unless --deepspeed_enable_sleep) and training (trainers, plus the engine unless --vllm_enable_sleep).
  On cpu every byte is host memory, summed over the ranks on a node.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from orlhf.config.resolve import resolve_device
from orlhf.config.roles import ROLES, model_path
from orlhf.config.train_config import TrainConfig, engine_gpu_memory_utilization
from orlhf.config.worker_config import zero_stage_of
from orlhf.distributed.layout import (
    ENGINE,
    GroupKey,
    Layout,
    NodeSpec,
    Slot,
    described_nodes,
    fit_report,
    format_table,
    local_num_cpus,
    plan_layout,
    simulate,
)
from orlhf.distributed.placement import live_nodes

GIB = 2**30


@dataclass(frozen=True)
class ClusterArgs:
    """The plan command's own flags: a described cluster, or memory figures Ray cannot report."""

    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    gpu_memory_gb: Optional[float] = None  # GiB per GPU
    host_memory_gb: Optional[float] = None  # GiB per node


# ---- Model size --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    source: str  # where the numbers came from
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # tie_word_embeddings: the LM head reuses the embedding matrix
    dtype_bytes: int = 2  # of the checkpoint (torch_dtype), what a vLLM engine loads


def read_dims(model_dir: str | Path) -> ModelDims:
    path = Path(model_dir) / "config.json"
    c = json.loads(path.read_text())
    try:
        heads = c["num_attention_heads"]
        dtype = c.get("torch_dtype") or c.get("dtype") or "bfloat16"
        return ModelDims(
            str(path),
            c["hidden_size"],
            c["num_hidden_layers"],
            c["intermediate_size"],
            c["vocab_size"],
            heads,
            c.get("num_key_value_heads") or heads,
            c.get("head_dim") or c["hidden_size"] // heads,
            bool(c.get("tie_word_embeddings", False)),
            4 if dtype == "float32" else 2,
        )
    except KeyError as e:
        raise ValueError(
            f"{path} has no {e}: orlhf plan sizes Llama-style configs (hidden_size, num_hidden_layers, "
            "intermediate_size, vocab_size, num_attention_heads)"
        ) from None


def demo_dims() -> ModelDims:
    """The built-in demo's sizes: its cached config.json when built, else the recipe's numbers (not built here:
    a plan must not import torch to make a model)."""
    try:
        from orlhf.demo import builder as demo

        cached = demo.default_cache_dir() / f"demo-v{demo.DEMO_VERSION}" / "model"
        if (cached / "config.json").is_file():
            return read_dims(cached)
        vocab = demo.VOCAB_SIZE
    except (ImportError, AttributeError, OSError, KeyError, ValueError):
        vocab = 1024
    return ModelDims(f"built-in demo (vocab <= {vocab})", 128, 2, 256, vocab, 4, 4, 32, False, 4)


def count_params(d: ModelDims, value_head: bool = False) -> int:
    """Parameters of a dense Llama-style model; value_head: no LM head, a hidden x 1 head (critic, reward)."""
    attn = 2 * d.hidden * d.heads * d.head_dim + 2 * d.hidden * d.kv_heads * d.head_dim  # q, o; k, v
    layer = attn + 3 * d.hidden * d.intermediate + 2 * d.hidden  # gate/up/down, two norms
    body = d.vocab * d.hidden + d.layers * layer + d.hidden  # embeddings, layers, final norm
    if value_head:
        return body + d.hidden
    return body + (0 if d.tied else d.vocab * d.hidden)


def role_dims(cfg: TrainConfig) -> dict[str, ModelDims]:
    d = cfg.data
    paths = {role: model_path(cfg, role) for role in ROLES}
    demo = demo_dims() if d.uses_demo else None  # the demo reward is a function: no reward model to size
    return {role: read_dims(p) if p else demo for role, p in paths.items() if p or demo}


# ---- Memory ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    who: str  # role, or "vllm" (one engine, per GPU)
    params: int
    ranks: int  # ranks that shard it (TP for an engine)
    device_gib: float  # per device
    host_gib: float  # per rank
    formula: str


# DeepSpeed 0.19.8 ZeRO-3 allocates its gradient reduce bucket whole on the device at start-up: reduce_bucket_size
# (default 5e8) elements of the gradient dtype, whatever the model's size (stage3.py, "IPG"). Measured on an H100
# with the 2-layer test Llama: ~950 MiB above the model states in bf16.
REDUCE_BUCKET_ELEMENTS = 500_000_000
# ZeRO-1/2 allocate one such bucket too, at the first backward (stage_1_and_2.py setup_buckets, contiguous gradients,
# no overlap_comm as orlhf configures it): the gradient dtype under ZeRO-2, an fp32 accumulator under ZeRO-1. Read
# from the source, not measured on a GPU; one-rank trained groups run ZeRO-2 by default (worker_config).


def bucket_bytes_per_element(stage: int, grad_bytes: int) -> int:
    """Bytes per reduce-bucket element of a trained rank on a GPU (0: no bucket, as under ZeRO-0)."""
    return {0: 0, 1: 4}.get(stage, grad_bytes)


def role_memory(cfg: TrainConfig, role: str, params: int, ranks: int, *, device: str) -> Memory:
    """One rank's memory for `role` (device_gib per GPU on cuda, per rank in RAM on cpu).

    On cuda a trained ZeRO-1/2/3 rank also holds DeepSpeed's reduce bucket (REDUCE_BUCKET_ELEMENTS x the gradient's
    bytes, fp32 under ZeRO-1); on cpu torch.empty leaves those pages untouched, so they cost no RAM and are not counted.
    """
    ds = cfg.deepspeed
    w = 2 if ds.bf16 else 4
    s, n = zero_stage_of(ds, role, ranks, device), ranks
    if not ROLES[role].trains:
        per = w * params / (n if s == 3 else 1)
        text = f"{w}P" + (f"/{n}" if s == 3 and n > 1 else "")
        on_host = ds.ref_reward_offload
        return Memory(
            role,
            params,
            n,
            0.0 if on_host else per / GIB,
            per / GIB if on_host else 0.0,
            text + (" on host (--ref_reward_offload)" if on_host else ""),
        )
    k = 12 if ds.bf16 else 8
    # (weights, grads, Adam) divisors by stage: which of the three ZeRO shards over the N ranks
    div = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[s]
    weights, grads, adam = w * params / div[0], w * params / div[1], k * params / div[2]
    parts = [f"{b}P" + (f"/{d}" if d > 1 else "") for b, d in zip((w, w, k), div)]
    text = " + ".join(parts[:2]) + (f" [+ {parts[2]} on host]" if ds.adam_offload else f" + {parts[2]}")
    per_element = bucket_bytes_per_element(s, w) if device == "cuda" else 0
    bucket = REDUCE_BUCKET_ELEMENTS * per_element
    if bucket:
        text += f" + {per_element} x 5e8 reduce bucket"
    on_device = weights + grads + (0 if ds.adam_offload else adam) + bucket
    return Memory(role, params, n, on_device / GIB, (adam if ds.adam_offload else 0) / GIB, text)


def engine_memory(cfg: TrainConfig, dims: ModelDims, device: str, gpu_memory_gb: Optional[float]) -> Memory:
    params, tp = count_params(dims), cfg.vllm.tensor_parallel_size
    weights = dims.dtype_bytes * params / tp / GIB
    if device == "cpu":
        kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        return Memory(ENGINE, params, tp, weights + kv / tp, 0.0, f"({dims.dtype_bytes}P + {kv:g} GiB KV cache)/{tp}")
    util = engine_gpu_memory_utilization(cfg)
    budget = util * gpu_memory_gb if gpu_memory_gb else math.nan
    return Memory(ENGINE, params, tp, budget, 0.0, f"{util:g} x GPU; weights {dims.dtype_bytes}P/{tp} = {weights:.1f}")


def device_peak(cfg: TrainConfig, trainers: float, engine: float) -> float:
    if not engine or not trainers:
        return trainers + engine
    generation = engine + (0.0 if cfg.deepspeed.enable_sleep else trainers)
    training = trainers + (0.0 if cfg.vllm.enable_sleep else engine)
    return max(generation, training)


# ---- Cluster -----------------------------------------------------------------------------------------------


def resolve_cluster(cfg: TrainConfig, args: ClusterArgs) -> tuple[str, Optional[list[NodeSpec]], str]:
    """(device, nodes, what they are). nodes is None for this machine on cpu: its size follows the layout."""
    want = cfg.runtime.device
    if args.nodes is not None:
        device = "cuda" if want == "auto" else want
        nodes = described_nodes(args.nodes, args.gpus_per_node, device, args.gpu_memory_gb, args.host_memory_gb)
        mem = f" x {args.gpu_memory_gb:g} GiB" if args.gpu_memory_gb else ""
        return device, nodes, f"described: {args.nodes} nodes x {args.gpus_per_node} {_unit(device)}{mem}"
    if cfg.runtime.address:
        nodes = _live(cfg.runtime.address, args)
        device = want if want != "auto" else ("cuda" if any(n.capacity(True)["GPU"] for n in nodes) else "cpu")
        return device, nodes, f"live Ray cluster at {cfg.runtime.address}: {len(nodes)} nodes, free resources now"
    device = want if want != "auto" else _local_device()
    if device == "cpu":
        return device, None, "this machine (a local CPU Ray cluster sized for the layout)"
    return device, [_local_gpu_node(args)], "this machine"


def _unit(device: str) -> str:
    return "GPU" if device == "cuda" else "CPU slots"


def _live(address: str, args: ClusterArgs) -> list[NodeSpec]:
    import ray

    own = not ray.is_initialized()  # already connected (a driver, a test): read that cluster, leave it be
    if own:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        nodes = live_nodes(args.gpu_memory_gb)
    finally:
        if own:
            ray.shutdown()
    return [replace(n, host_memory_gb=args.host_memory_gb) for n in nodes] if args.host_memory_gb else nodes


def _host_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _local_gpu_node(args: ClusterArgs) -> NodeSpec:
    import torch

    mem = args.gpu_memory_gb or torch.cuda.get_device_properties(0).total_memory / GIB
    return NodeSpec(
        "local",
        "127.0.0.1",
        float(torch.cuda.device_count()),
        float(os.cpu_count() or 1),
        mem,
        args.host_memory_gb or _host_gib(),
    )


def _local_cpu_node(layout: Layout, args: ClusterArgs) -> NodeSpec:
    return NodeSpec("local", "127.0.0.1", 0.0, float(local_num_cpus(layout)), None, args.host_memory_gb or _host_gib())


# ---- Report ------------------------------------------------------------------------------------------------


def run_plan(cfg: TrainConfig, args: ClusterArgs) -> int:
    """Print the plan; 0 when it fits, 1 when something cannot be placed or will not fit."""
    device, nodes, where = resolve_cluster(cfg, args)
    cfg = resolve_device(cfg, device)  # the described / live cluster's device, not necessarily this machine's
    layout = plan_layout(cfg)
    nodes = nodes if nodes is not None else [_local_cpu_node(layout, args)]
    try:
        text, ok = render(cfg, layout, nodes, where)
    except ValueError as e:  # a model folder plan cannot size
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


def render(cfg: TrainConfig, layout: Layout, nodes: list[NodeSpec], where: str) -> tuple[str, bool]:
    placed, unplaced = simulate(layout, nodes)
    dims = role_dims(cfg)
    lines = [
        f"orlhf plan: device {layout.device}; cluster {where}",
        f"model: {_count(count_params(dims['actor']))} params ({dims['actor'].source})",
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


def _gib(x: float) -> str:
    return "?" if math.isnan(x) else f"{x:.1f}" if x >= 10 or x == 0 else f"{x:.3g}"


def placement_section(layout: Layout, nodes: list[NodeSpec], placed: dict[GroupKey, int]) -> list[str]:
    rows = []
    for role, slots in layout.roles.items():
        pool = layout.pool(slots[0].pool)
        rows += _placement_rows(role, f"{len(slots)} ({pool.num_groups}x{pool.group_size})", slots, nodes, placed)
    for i, slots in enumerate(layout.engines):
        rows += _placement_rows(f"{ENGINE}{i}", f"TP {len(slots)}", slots, nodes, placed)
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
    mems = {
        role: role_memory(
            cfg, role, count_params(dims[role], value_head=ROLES[role].value_head), len(slots), device=layout.device
        )
        for role, slots in layout.roles.items()
    }
    known = [n.gpu_memory_gb for n in nodes if n.gpu_memory_gb]
    eng = engine_memory(cfg, dims["actor"], layout.device, min(known) if known else None)
    per = "GPU GiB/rank" if layout.device == "cuda" else "GiB/rank"
    rows = [[m.who, _count(m.params), m.ranks, _gib(m.device_gib), _gib(m.host_gib), m.formula] for m in mems.values()]
    rows.append([f"{ENGINE} (each)", _count(eng.params), f"TP {eng.ranks}", _gib(eng.device_gib), "0", eng.formula])
    held = "model states and DeepSpeed's reduce bucket" if layout.device == "cuda" else "model states"
    stages = ", ".join(
        f"{role} {zero_stage_of(cfg.deepspeed, role, len(slots), layout.device)}"
        for role, slots in layout.roles.items()
    )
    lines = [
        f"memory estimate ({held}; activations come on top; "
        f"{'bf16' if cfg.deepspeed.bf16 else 'fp32'}, ZeRO stage: {stages}; P = params):",
        format_table(["who", "params", "ranks", per, "host GiB/rank", "formula"], rows),
    ]
    problems: list[str] = []
    if layout.device == "cuda":
        lines += ["", *_device_sums(cfg, layout, nodes, placed, mems, eng, dims["actor"], problems)]
    lines += ["", *_host_sums(cfg, layout, nodes, placed, mems, eng, problems)]
    return lines, problems


def _pool_load(cfg: TrainConfig, occupants: tuple[str, ...], mems: dict[str, Memory], eng: Memory, attr: str) -> float:
    trainers = sum(getattr(mems[r], attr) for r in occupants if r in mems)
    engine = getattr(eng, attr) if any(o.startswith(ENGINE) for o in occupants) else 0.0
    return device_peak(cfg, trainers, engine) if attr == "device_gib" else trainers + engine


def _device_sums(
    cfg: TrainConfig,
    layout: Layout,
    nodes: list[NodeSpec],
    placed: dict[GroupKey, int],
    mems: dict[str, Memory],
    eng: Memory,
    actor_dims: ModelDims,
    problems: list[str],
) -> list[str]:
    rows = []
    for pool in layout.pools:
        caps = [nodes[placed[(pool.name, g)]].gpu_memory_gb for g in range(pool.num_groups) if (pool.name, g) in placed]
        caps = [c for c in caps if c] or [n.gpu_memory_gb for n in nodes if n.gpu_memory_gb]
        cap = min(caps) if caps else None
        need = _pool_load(cfg, pool.occupants, mems, eng, "device_gib")
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
    weights = actor_dims.dtype_bytes * eng.params / eng.ranks / GIB
    if weights > eng.device_gib:  # NaN (unknown GPU memory) compares False: no claim
        problems.append(
            f"vLLM weights take {weights:.1f} GiB per GPU, more than its {eng.device_gib:.1f} GiB budget: "
            "raise --vllm_tensor_parallel_size or --vllm_gpu_memory_utilization"
        )
    note = "" if any(n.gpu_memory_gb for n in nodes) else " (GPU memory unknown: pass --gpu_memory_gb)"
    return [
        f"per GPU (occupants of one GPU add up; sleep flags take the larger phase){note}:",
        format_table(["pool", "GiB needed", "GiB per GPU", "status"], rows),
    ]


def _host_sums(
    cfg: TrainConfig,
    layout: Layout,
    nodes: list[NodeSpec],
    placed: dict[GroupKey, int],
    mems: dict[str, Memory],
    eng: Memory,
    problems: list[str],
) -> list[str]:
    attrs = ("host_gib", "device_gib") if layout.device == "cpu" else ("host_gib",)
    rows, total = [], 0.0
    for i, node in enumerate(nodes):
        need = sum(
            layout.pool(k[0]).group_size * _pool_load(cfg, layout.pool(k[0]).occupants, mems, eng, a)
            for k, n in placed.items()
            if n == i
            for a in attrs
        )
        total += need
        cap = node.host_memory_gb
        status = "?" if cap is None else "ok" if need <= 0.9 * cap else "tight" if need <= cap else "NOT FIT"
        if status == "NOT FIT":
            problems.append(f"node {node.name} needs {need:.1f} GiB of host memory, more than {cap:.1f}")
        rows.append([node.name, _gib(need), "?" if cap is None else f"{cap:.1f}", status])
    if not any(n.host_memory_gb for n in nodes):
        return [f"host memory: {_gib(total)} GiB in all across nodes; not checked (pass --host_memory_gb)."]
    return [
        f"host memory per node (offloaded states{', and every rank on cpu' if layout.device == 'cpu' else ''}):",
        format_table(["node", "GiB needed", "GiB on node", "status"], rows),
    ]
