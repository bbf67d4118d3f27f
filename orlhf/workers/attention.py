"""Which attention kernels a worker's model loads with, and the one orlhf adds: SDPA computed in fp32 for bf16
models that train on a CPU.

    attn_implementation(cfg) -> "flash_attention_2" (--flash_attn) | "eager" (--eager_attention)
                                | SDPA_FP32 (a trained model, --bf16, --device cpu) | "sdpa"

torch's CPU SDPA runs its flash-attention kernel, whose backward in bf16 is several times slower than in fp32 on the
same shapes, even on a CPU with native bf16 (AMX): on SmolLM2-135M's train step it was the largest single cost
(benchmarks/results/2026-12-02-bf16-real-model.md), where the matrix products it surrounds run faster in bf16. The
attention's own products are a small part of a step at RL's lengths; its inputs are not. So a trained bf16 model on
CPU computes attention in fp32: query, key and value cast up, transformers' own SDPA function (same masks, same
kernel choice, the flash kernel's memory that does not grow with the square of the length), the output cast back.
Frozen models (reference, reward) keep bf16 SDPA: its forward is fast. On GPUs nothing changes.
"""

from __future__ import annotations

import torch

SDPA_FP32 = "orlhf_sdpa_fp32"


def attn_implementation(cfg) -> str:
    """The attn_implementation `cfg`'s model loads with (module docstring)."""
    if cfg.flash_attn:
        return "flash_attention_2"
    if cfg.eager_attention:
        return "eager"
    if cfg.device == "cpu" and cfg.bf16 and cfg.trainable:
        register()
        return SDPA_FP32
    return "sdpa"


def register() -> None:
    """Make SDPA_FP32 a name transformers' from_pretrained takes (its attention and mask registries); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SDPA_FP32, sdpa_fp32_attention)
    AttentionMaskInterface.register(SDPA_FP32, sdpa_mask)


def sdpa_fp32_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa_attention_forward on fp32 copies of a 16-bit layer's inputs; the output in their dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights
