"""The trainer's parameter names -> the names a checkpoint on disk has, which is what vLLM loads.

transformers 5 renames and fuses some weights at load time and undoes it in `save_pretrained`: Mixtral's
`block_sparse_moe.experts.N.w1/w3.weight` become one `mlp.experts.gate_up_proj` (E, 2I, H) at run time,
Qwen2-MoE's `mlp.experts.N.gate_proj/up_proj` likewise. vLLM only knows the checkpoint names, so every tensor
that leaves the trainer for an engine goes through the same reverse conversion `save_pretrained` applies
(transformers' own `revert_weight_conversion`, no table of ours).

Tied weights are not sent twice: `named_parameters()` lists a shared tensor once, under its source
(`model.embed_tokens.weight`), and that is what goes to the engines. vLLM ties the same way and skips
`lm_head.*` (Gemma 2 has no `lm_head` module at all and refuses the name); what it does not do is re-pack a tied
head after a reload, which the engine side fixes (rollout/reload_fixes.py).

Conversions act within one decoder layer, so a group of whole layers converts on its own; the conversion of a
group of meta tensors (shapes only) gives the same names, shapes and order as the real one, which lets rank 0
plan a sync without gathering ZeRO-3 shards.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def to_checkpoint_names(
    model: nn.Module, group: list[tuple[str, Optional[torch.Tensor]]]
) -> list[tuple[str, Optional[torch.Tensor]]]:
    """One group of whole layers with transformers' load-time conversions reverted (runtime -> checkpoint names).

    Tensors may be real or on the meta device; they come back as views where a conversion splits a fused one.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return list(group)
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(model, dict(group)).items())


def meta_group(group: list[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    """Shape-only stand-ins for a group of (possibly ZeRO-3-partitioned) parameters: (name, meta tensor)."""
    return [(n, torch.empty(tuple(getattr(p, "ds_shape", p.shape)), dtype=p.dtype, device="meta")) for n, p in group]
