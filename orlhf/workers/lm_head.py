"""The LM head of a causal-LM worker taken out of the model's forward, so log-probs and entropy come from the hidden
states a chunk of tokens at a time (algo/chunked_logprobs.py, --logprobs_chunk_mb) instead of the whole (B, A, V)
logits.

    with hidden_states_out(head):  model(...)            the head returns its input: "logits" are hidden states,
                                                         sliced as every forward path (plain, shared prompt,
                                                         packed) slices its logits
    head_log_probs(head, hidden[:, window], tokens, ...)  the head called once more, its forward the chunked
                                                         log-probs: under ZeRO-3 its hooks gather the weight for
                                                         the forward and again for the backward, as for any module

Only for a plain nn.Linear head without bias whose logits the model uses as they come out (no soft-capping or
scaling after the head, no MoE router loss riding on the forward's output); other models keep the whole logits.
A vision-language model's head is its top-level output embeddings (lm_head) and its language model's last hidden
states reach it the same way.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from orlhf.algo.chunked_logprobs import chunk_rows, chunked_log_probs_entropy

# config.json keys of models that change the logits after the head (Gemma 2/3, Cohere, Granite)
_AFTER_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def chunked_head(model: nn.Module, tokens: int, chunk_mb: float) -> Optional[tuple[nn.Linear, int]]:
    """(the head, rows per chunk) when `tokens` action tokens' logits would exceed one chunk and the model allows
    it; None: the whole logits."""
    if chunk_mb <= 0:
        return None
    hf = getattr(model, "module", model)  # a DeepSpeedEngine
    hf = hf.get_base_model() if hasattr(hf, "get_base_model") else hf  # peft
    config = getattr(hf, "config", None)
    if config is None:
        return None
    # a vision-language model's text settings sit in its text config (Gemma 3's soft-capping)
    configs = (config, config.get_text_config()) if hasattr(config, "get_text_config") else (config,)
    if any(getattr(c, k, None) not in (None, 1.0) for c in configs for k in _AFTER_HEAD):
        return None
    if any(getattr(c, "output_router_logits", False) for c in configs):
        return None
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.bias is not None:  # a LoRA-adapted head is a peft layer: whole logits
        return None
    rows = chunk_rows(head.out_features, chunk_mb)
    return (head, rows) if tokens > rows else None


@contextmanager
def _forward_as(head: nn.Module, forward):
    saved = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


def hidden_states_out(head: nn.Module):
    """While the block runs, the head returns its input: the model's "logits" are its last hidden states."""
    return _forward_as(head, lambda hidden: hidden)


def head_log_probs(
    head: nn.Linear, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (B, A, H) of the positions that predict tokens (B, A) -> (log-probs, entropy) (B, A) float32, both in
    the graph, through the head's own call (ZeRO-3 gathers its weight for it). entropy=False: zeros, not computed."""
    with _forward_as(head, lambda h: chunked_log_probs_entropy(h, head.weight, tokens, temperature, rows, entropy)):
        return head(hidden)
