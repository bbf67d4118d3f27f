"""The memory model of `orlhf plan` (launch/plan.py): model sizes from config.json, each role's bytes per device.

GiB = 2**30 bytes. Model states, plus on GPUs DeepSpeed's reduce bucket under ZeRO-1/2/3 (5e8 gradient elements,
allocated whole per trained rank: + 2 x 5e8 B in bf16, fp32 under ZeRO-1); activations and gathered ZeRO-3 layers
come on top, so keep headroom ("tight" marks > 90%).
  P = parameters, counted from config.json (dense Llama-style: embeddings, attention with grouped KV heads,
      gated MLP, norms; biases ignored). Critic and reward: no LM head, a value head (hidden x 1).
  w = bytes per weight: 2 with --bf16, else 4; gradients the same. K = Adam states: 12 with --bf16 (fp32 master
      + m + v); in fp32 8 under ZeRO-0/3 (the weights are the master: m + v) and 12 under ZeRO-1/2, whose
      optimizer clones an fp32 master partition whatever the model's dtype (DeepSpeed's stage_1_and_2.py).
  trained (actor, critic) on N ranks, by ZeRO stage (ZeRO paper / DeepSpeed docs):
      0: (w + w + K)P    1: (w + w)P + KP/N    2: wP + (w + K)P/N    3: (w + w + K)P/N
      --adam_offload moves the K part to host memory.
  frozen (ref, reward): wP/N at stage 3, wP otherwise; --ref_reward_offload moves it to host memory.
  LoRA (--lora_rank r): L = r x (in + out) per adapted Linear; the trained roles hold w(P + L) weights and the
      gradients and Adam states of L only; no reference model (the actor's adapter-off forward is the reference).
  vLLM engine: vllm_gpu_memory_utilization x GPU memory, on each of its TP GPUs; its weights (2P/TP) must fit
      inside that, the rest is KV cache. On cpu: weights in the trainer's dtype + the KV cache orlhf gives it
      (--vllm_cpu_kv_cache_gb, else what 256 full-length sequences need, at most 1 GiB); launch/plan_cpu.py adds
      what else each CPU process holds (libraries, activations, the LM head's packed copy, Ray, the driver).
  --vllm_sync_delta: actor rank 0 and each engine worker hold one copy of the synced weights in the engines'
      dtype (e = 2 for bf16 engines, else 4: eP, P an upper bound under LoRA), in host memory.
  Occupants of one device add up. With an engine there, the peak is the larger of generation (engine, plus the
  trainers unless --deepspeed_enable_sleep) and training (trainers, plus the engine unless --vllm_enable_sleep).
  On cpu every byte is host memory, summed over the ranks on a node.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from orlhf.config.roles import ROLES, model_path
from orlhf.config.rollout_backends import ON_ACTOR, ON_ENGINES
from orlhf.config.train_config import TrainConfig, engine_gpu_memory_utilization
from orlhf.config.worker_config import zero_stage_of

GIB = 2**30


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
    """The sizes in a model's config.json: a local folder's, or a hub id's (downloaded, or from the local hub cache;
    only config.json). ValueError naming the fix when there is none to read."""
    path = _config_json(str(model_dir))
    top = json.loads(path.read_text())
    # A vision-language model: its language model's sizes (text_config); the vision encoder is not counted.
    c = {**top, **top["text_config"]} if isinstance(top.get("text_config"), dict) else top
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
            bool(top.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
            4 if dtype == "float32" else 2,
        )
    except KeyError as e:
        raise ValueError(
            f"{path} has no {e}: orlhf plan sizes Llama-style configs (hidden_size, num_hidden_layers, "
            "intermediate_size, vocab_size, num_attention_heads)"
        ) from None


def _config_json(model: str) -> Path:
    local = Path(model).expanduser() / "config.json"
    if local.is_file():
        return local
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json"))
    except Exception as e:  # noqa: BLE001 - no network, no such repo, offline mode: one message for all
        raise ValueError(
            f"{model}: no config.json to size it from (not a local folder, and the hub gave none: "
            f"{type(e).__name__}). Pass a local model folder, or fetch its config first "
            f"(huggingface-cli download {model} config.json)."
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


# The Linear layers of a Llama-style decoder layer: (in, out) as functions of the dims; all-linear adapts them all.
LLAMA_LINEARS = {
    "q_proj": lambda d: (d.hidden, d.heads * d.head_dim),
    "k_proj": lambda d: (d.hidden, d.kv_heads * d.head_dim),
    "v_proj": lambda d: (d.hidden, d.kv_heads * d.head_dim),
    "o_proj": lambda d: (d.heads * d.head_dim, d.hidden),
    "gate_proj": lambda d: (d.hidden, d.intermediate),
    "up_proj": lambda d: (d.hidden, d.intermediate),
    "down_proj": lambda d: (d.intermediate, d.hidden),
}


def count_lora_params(d: ModelDims, rank: int, targets: "str | tuple[str, ...]") -> int:
    """A LoRA adapter's parameters: rank x (in + out) per adapted Linear (A is rank x in, B out x rank), per layer.
    Names outside a Llama-style layer count nothing (plan sizes Llama-style configs)."""
    names = LLAMA_LINEARS if targets == "all-linear" else [t for t in targets if t in LLAMA_LINEARS]
    return d.layers * sum(rank * sum(LLAMA_LINEARS[n](d)) for n in names)


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
# (default 5e8) elements of the gradient dtype, whatever the model's size (stage3.py, "IPG");
# tests/gpu/test_workers_gpu.py checks the estimate against the allocator's peak.
REDUCE_BUCKET_ELEMENTS = 500_000_000
# ZeRO-1/2 allocate one such bucket too, at the first backward (stage_1_and_2.py setup_buckets, contiguous gradients,
# no overlap_comm as orlhf configures it): the gradient dtype under ZeRO-2, an fp32 accumulator under ZeRO-1. Read
# from the source, not measured on a GPU; one-rank trained groups run ZeRO-2 only in bf16 or where they need ZeRO's
# optimizer (worker_config.zero_stage_of).


def gib_text(x: float) -> str:
    """GiB as the plan prints them: three significant figures below 10, one decimal above; ? when unknown."""
    return "?" if math.isnan(x) else f"{x:.1f}" if x >= 10 or x == 0 else f"{x:.3g}"


def bucket_bytes_per_element(stage: int, grad_bytes: int) -> int:
    """Bytes per reduce-bucket element of a trained rank on a GPU (0: no bucket, as under ZeRO-0)."""
    return {0: 0, 1: 4}.get(stage, grad_bytes)


def role_memory(cfg: TrainConfig, role: str, params: int, ranks: int, *, device: str, adapter: int = 0) -> Memory:
    """One rank's memory for `role` (device_gib per GPU on cuda, per rank in RAM on cpu). `adapter`: a trained role's
    LoRA parameters L: then only they have gradients and Adam states, beside the frozen P (w(P + L) + wL + KL).

    On cuda a trained ZeRO-1/2/3 rank also holds DeepSpeed's reduce bucket (REDUCE_BUCKET_ELEMENTS x the gradient's
    bytes, fp32 under ZeRO-1); on cpu torch.empty leaves those pages untouched, so they cost no RAM and are not counted.
    """
    ds = cfg.deepspeed
    w = 2 if ds.bf16 else 4
    s, n = zero_stage_of(cfg, role, ranks, device), ranks
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
    k = 12 if ds.bf16 or s in (1, 2) else 8  # ZeRO-1/2 clone an fp32 master partition even of fp32 weights
    # (weights, grads, Adam) divisors by stage: which of the three ZeRO shards over the N ranks
    div = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[s]
    trained = adapter or params
    weights, grads, adam = w * (params + adapter) / div[0], w * trained / div[1], k * trained / div[2]
    sym = ("P + L", "L", "L") if adapter else ("P", "P", "P")
    parts = [
        (f"{b}({x})" if "+" in x else f"{b}{x}") + (f"/{d}" if d > 1 else "") for b, x, d in zip((w, w, k), sym, div)
    ]
    text = " + ".join(parts[:2]) + (f" [+ {parts[2]} on host]" if ds.adam_offload else f" + {parts[2]}")
    per_element = bucket_bytes_per_element(s, w) if device == "cuda" else 0
    bucket = REDUCE_BUCKET_ELEMENTS * per_element
    if bucket:
        text += f" + {per_element} x 5e8 reduce bucket"
    on_device = weights + grads + (0 if ds.adam_offload else adam) + bucket
    on_host = adam if ds.adam_offload else 0
    held = delta_copy_bytes(cfg, params, device) if role == "actor" else 0
    if held:  # counted on every rank; only rank 0 holds it
        text += f" + {held // params}P held copy (--vllm_sync_delta)"
        on_device, on_host = (on_device + held, on_host) if device == "cpu" else (on_device, on_host + held)
    return Memory(role, params, n, on_device / GIB, on_host / GIB, text)


def delta_copy_bytes(cfg: TrainConfig, params: int, device: str) -> int:
    """--vllm_sync_delta's copy of the synced weights in the engines' dtype, held in host memory by actor rank 0 and
    by each engine worker (rollout/weight_sync.py); 0 without it, or without engines."""
    if not cfg.vllm.sync_delta or cfg.rollout.memory != ON_ENGINES:
        return 0
    return (2 if cfg.deepspeed.bf16 or device == "cuda" else 4) * params  # rollout/engine_config.engine_dtype


def engine_memory(cfg: TrainConfig, dims: ModelDims, device: str, gpu_memory_gb: Optional[float]) -> Memory:
    params, tp = count_params(dims), cfg.vllm.tensor_parallel_size
    weights = dims.dtype_bytes * params / tp / GIB
    if device == "cpu":  # one process, no TP (rollout/engine.py)
        w, kv = cpu_engine_bytes(cfg, dims)
        return Memory(
            cfg.rollout.engine, params, 1, (w * params + kv) / GIB, 0.0, f"{w}P + {kv / GIB:.3g} GiB KV cache"
        )
    util = engine_gpu_memory_utilization(cfg)
    budget = util * gpu_memory_gb if gpu_memory_gb else math.nan
    held = delta_copy_bytes(cfg, params, device)  # on the host, per TP worker
    text = f"{util:g} x GPU; weights {dims.dtype_bytes}P/{tp} = {weights:.1f}" + (" + 2P held on host" if held else "")
    return Memory(cfg.rollout.engine, params, tp, budget, held / GIB, text)


def cpu_engine_bytes(cfg: TrainConfig, dims: ModelDims) -> tuple[int, int]:
    """(bytes per weight, KV cache bytes) of a CPU engine: the trainer's dtype (rollout/engine_config.py), the KV
    cache sized as the engine sizes it (cpu/engine_kv.py: what 256 full sequences need, at most 1 GiB, or the flag)."""
    from orlhf.cpu.engine_kv import sized_kv_bytes  # cpu only: a cuda run never imports orlhf.cpu

    w, p = (2 if cfg.deepspeed.bf16 else 4), cfg.ppo
    per_token = dims.layers * 2 * dims.kv_heads * dims.head_dim * w
    return w, sized_kv_bytes(per_token, p.prompt_max_len + p.generate_max_len, cfg.vllm.cpu_kv_cache_gb)


def trainer_generation_memory(cfg: TrainConfig, dims: ModelDims, ranks: int, stage: int) -> Memory:
    """--rollout_backend trainer: what an actor rank adds while it generates: the whole model gathered for generate
    (ZeRO-3 over several ranks; otherwise the rank holds it already) and the KV cache of its share of the batch."""
    p, params = cfg.ppo, count_params(dims)
    width = 2 if cfg.deepspeed.bf16 else 4
    rows = -(-p.rollout_batch_size // ranks) * p.n_samples_per_prompt
    tokens = p.prompt_max_len + p.generate_max_len
    kv = rows * tokens * 2 * dims.layers * dims.kv_heads * dims.head_dim * width / GIB
    gathered = width * params / GIB if stage == 3 and ranks > 1 else 0.0
    formula = f"KV {rows} seq x {tokens} tok" + (f" + gathered {width}P" if gathered else "")
    return Memory("generate", params, ranks, kv + gathered, 0.0, formula)


def device_peak(cfg: TrainConfig, trainers: float, engine: float) -> float:
    if (
        cfg.rollout.memory == ON_ACTOR
    ):  # the actor's ranks generate: their generation memory comes on top of their states
        return trainers + engine
    if not engine or not trainers:
        return trainers + engine
    generation = engine + (0.0 if cfg.deepspeed.enable_sleep else trainers)
    training = trainers + (0.0 if cfg.vllm.enable_sleep else engine)
    return max(generation, training)
