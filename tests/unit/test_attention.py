"""Which attention kernels a worker's model loads with (workers/attention.py); the fp32 SDPA of a bf16 layer against
bf16 SDPA and against fp32 on a random layer (pure torch: no model)."""

from types import SimpleNamespace

import pytest
import torch

from orlhf.workers.attention import SDPA_FP32, attn_implementation, sdpa_fp32_attention


def cfg(**kw):
    base = dict(flash_attn=False, eager_attention=False, device="cpu", bf16=False, trainable=True)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, "sdpa"),  # fp32 on CPU: the flash kernel's fp32 backward is fast
        ({"bf16": True}, SDPA_FP32),  # a bf16 model that trains on CPU
        ({"bf16": True, "trainable": False}, "sdpa"),  # frozen: bf16 SDPA's forward is fast
        ({"bf16": True, "device": "cuda"}, "sdpa"),  # GPUs: unchanged
        ({"bf16": True, "eager_attention": True}, "eager"),  # asked for: given
        ({"bf16": True, "flash_attn": True, "device": "cuda"}, "flash_attention_2"),
    ],
)
def test_the_kernels_by_device_dtype_and_role(kw, want):
    assert attn_implementation(cfg(**kw)) == want


def test_registered_with_transformers():
    from transformers import AttentionInterface

    attn_implementation(cfg(bf16=True))
    assert SDPA_FP32 in AttentionInterface._global_mapping


def test_fp32_sdpa_of_a_bf16_layer_is_closer_to_fp32_and_keeps_the_dtype():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 16, generator=g) for _ in range(3))  # (B, heads, T, head dim)
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    layer = SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    fp32, _ = sdpa_fp32_attention(layer, q, k, v, mask)
    up, _ = sdpa_fp32_attention(layer, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    plain = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=mask)
    assert up.dtype == torch.bfloat16
    assert (up.float() - fp32).abs().max() <= (plain.transpose(1, 2).float() - fp32).abs().max()
