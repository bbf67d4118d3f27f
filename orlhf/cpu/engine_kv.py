"""The KV cache size of a CPU engine (--vllm_cpu_kv_cache_gb), sized from what the engine can hold at once.

    kv_cache_bytes(cfg) -> bytes for vLLM's kv_cache_memory_bytes (sized_kv_bytes: the same from K/V bytes a token,
                           which `orlhf plan` computes from the model's dims)
        user-given --vllm_cpu_kv_cache_gb: that size (refused if it cannot hold one max_model_len sequence)
        not given: what MAX_NUM_SEQS full-length sequences need, at most DEFAULT_GB
    check_kv_cache(llm, cfg, requested) -> after LLM(): the blocks vLLM made hold MAX_NUM_SEQS full sequences
    block_args(cfg) -> the engine's block size and prefix caching (plain attention: blocks of BLOCK_TOKENS,
                       prefix caching on where the engine config shares prompts)

Why: vLLM sizes the cache from most of the host's memory when not told, and a small model's run needs far less.
orlhf's CPU engines touch only the pages generation writes (cpu/engine_lean.py), but a cache sized to the host
would still be what `orlhf plan` must count, and what a long run's engine could come to hold.
The automatic size never changes what the engine samples: the scheduler never runs more than MAX_NUM_SEQS
sequences of at most max_model_len tokens, so a cache that holds them all never preempts, exactly as a
DEFAULT_GB cache does when it is larger; where the need exceeds DEFAULT_GB the size stays DEFAULT_GB. (With
prefix caching a smaller cache keeps fewer finished prefixes around between calls.)

Why prefix caching on CPU engines: a step asks for n samples of each prompt, and without it each sample computes
the prompt's keys and values again: n prefills where one would do, most of a short-answer generation's time on a
CPU. vLLM caches a request's full blocks when it schedules them, so the other samples of the same prompt, scheduled
in the same step, attend to those blocks instead of computing them (a prompt's tail shorter than a block is still
computed per sample). vLLM-CPU's default block of 128 tokens would share nothing of a shorter prompt: orlhf asks
for 32, the smallest its attention kernel takes. The cache is reset after every weight sync (rollout/weight_sync.py),
so no sample attends to keys an older policy computed. In fp32 the samples are bit-identical with and without it;
in bf16 a shared prompt's keys and values are rounded as they were computed in another batch, so samples differ
in rounding (the sync guard's start-up calibration measures the engine gap with sharing on).

The need is estimated from the model's config.json for plain attention models (layers x 2 x KV heads x head dim
x dtype bytes a token, blocks of BLOCK_TOKENS, the block size orlhf gives them, plus vLLM's reserved null
block); any other architecture (MLA, hybrid / linear attention) keeps DEFAULT_GB.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

log = logging.getLogger(__name__)

DEFAULT_GB = 1.0
MAX_NUM_SEQS = 256  # vLLM's CPU default for the LLM class (arg_utils), passed explicitly so the sizing holds
BLOCK_TOKENS = 32  # orlhf's block size for plain attention on CPU: the smallest vLLM-CPU's attention takes
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_NOT_PLAIN = (
    "kv_lora_rank",
    "layers_block_type",
    "hybrid_override_pattern",
    "sliding_window",
    "linear_attn_config",
    "text_config",
)


def kv_bytes_per_token(model_path: str, dtype: str) -> Optional[int]:
    """K and V bytes one token takes over all layers, or None when the config is not plain attention."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return None
    if any(c.get(k) for k in _NOT_PLAIN) or dtype not in _DTYPE_BYTES:
        return None
    if any(t != "full_attention" for t in c.get("layer_types") or ()):  # sliding / linear / mamba layers
        return None
    try:
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
        layers = int(c["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def block_args(cfg) -> dict:
    """The LLM() arguments that set a CPU engine's (EngineConfig) blocks: for plain attention models blocks of
    BLOCK_TOKENS and, with cfg.share_prompts, prefix caching on (the module's docstring says why); none for other
    architectures, which keep vLLM's own block size (MLA and hybrid models have their own) and
    --enable_prefix_caching as given. share_prompts is off with --router_replay R3: orlhf records the experts of the
    tokens an engine computes, and a cached prompt block computes none."""
    if kv_bytes_per_token(cfg.model_path, cfg.dtype) is None:
        return {}
    return {"block_size": BLOCK_TOKENS, **({"enable_prefix_caching": True} if cfg.share_prompts else {})}


def _blocks_per_seq(max_model_len: int) -> int:
    return math.ceil(max_model_len / BLOCK_TOKENS)


def kv_cache_bytes(model_path: str, dtype: str, max_model_len: int, user_gb: Optional[float]) -> int:
    return sized_kv_bytes(kv_bytes_per_token(model_path, dtype), max_model_len, user_gb)


def sized_kv_bytes(per_token: Optional[int], max_model_len: int, user_gb: Optional[float]) -> int:
    """The cache for K and V of `per_token` bytes a token (None: not plain attention): the user's size, else
    what MAX_NUM_SEQS full sequences need, at most DEFAULT_GB. `orlhf plan` sizes a CPU engine with it too."""
    if user_gb is not None:
        requested = int(user_gb * 2**30)
        one_seq = None if per_token is None else (_blocks_per_seq(max_model_len) + 1) * BLOCK_TOKENS * per_token
        if one_seq is not None and requested < one_seq:
            raise ValueError(
                f"--vllm_cpu_kv_cache_gb {user_gb} cannot hold one sequence of {max_model_len} tokens "
                f"(--prompt_max_len + --generate_max_len) of this model: it needs at least "
                f"{one_seq / 2**30:.4f} GiB. Give a larger size, or leave the flag out to size it automatically."
            )
        return requested
    default = int(DEFAULT_GB * 2**30)
    if per_token is None:
        return default
    need = (MAX_NUM_SEQS * _blocks_per_seq(max_model_len) + 1) * BLOCK_TOKENS * per_token
    return min(default, need)


def check_kv_cache(llm, max_model_len: int, requested: int) -> None:
    """After LLM(): an automatic size below DEFAULT_GB must hold MAX_NUM_SEQS full sequences in vLLM's blocks
    (else the estimate above is wrong for this model, and the engine could preempt where it did not before)."""
    if requested >= int(DEFAULT_GB * 2**30):
        return
    cache = llm.llm_engine.vllm_config.cache_config
    blocks, block = cache.num_gpu_blocks, cache.block_size
    need = MAX_NUM_SEQS * math.ceil(max_model_len / block) + 1
    if blocks is None or blocks < need:
        raise RuntimeError(
            f"orlhf sized this engine's KV cache to {requested / 2**20:.1f} MiB but vLLM made {blocks} blocks of "
            f"{block} tokens, fewer than {need} for {MAX_NUM_SEQS} sequences of {max_model_len} tokens: give "
            f"--vllm_cpu_kv_cache_gb {DEFAULT_GB} (the automatic size's bound) and report this model's config.json."
        )
    log.info(
        "CPU KV cache: %.1f MiB, %d blocks of %d tokens (%d sequences of %d tokens)",
        requested / 2**20,
        blocks,
        block,
        MAX_NUM_SEQS,
        max_model_len,
    )
