"""Log-probabilities of chosen tokens from LM logits, with a hand-written backward.

    logits (B, L, V), window [offset, offset + A), tokens (B, A)
        --x = logits[:, window] / temperature--> log softmax(x)[token] = x[token] - logsumexp(x)   (B, A)

The forward is the same ops autograd would run (gather, logsumexp), so values are bit-identical. The backward
is what autograd computes, d/dx = g * onehot(token) - g * exp(x - logsumexp(x)), in one pass: autograd builds it
from three nodes (GatherBackward, LogsumexpBackward, then SliceBackward for the window), each allocating and
filling a (B, L, V) or (B, A, V) tensor of zeros and adding them up, a visible share of a small model's train
step (benchmarks/bench_train_step.py measures one). The same float operations in the same order give bit-identical
gradients (tests/unit/test_logprobs.py checks against autograd).

The softmax exp(x - logsumexp(x)) is computed in the forward and kept for the backward (in place of x, so no more
memory is held): with entropy=True the forward also returns the entropy of every position, -sum(p * log p) from
that same softmax, for the training log (detached), instead of a separate log_softmax pass over the logits.
"""

from __future__ import annotations

import torch


def window(logits: torch.Tensor, offset: int, num_actions: int, temperature: float) -> torch.Tensor:
    """logits[:, offset:offset + A] / temperature; dividing by 1.0 is exact in IEEE floats, so it is skipped."""
    x = logits[:, offset : offset + num_actions].float()
    return x if temperature == 1.0 else x / temperature


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, offset: int = 0, temperature: float = 1.0):
    """(B, A) log softmax(logits[:, offset:offset + A] / temperature)[tokens], differentiable in `logits`."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogProbs.apply(logits, tokens, offset, temperature, False)[0]
    return _forward(window(logits, offset, tokens.shape[1], temperature), tokens)[0]


def token_log_probs_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, offset: int = 0, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_log_probs(...), (B, A) entropy of softmax(logits[:, offset:offset + A] / temperature), detached)."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TokenLogProbs.apply(logits, tokens, offset, temperature, True)
    x = window(logits, offset, tokens.shape[1], temperature)
    out, lse = _forward(x, tokens)
    return out, _entropy(x, lse)[1]


def _entropy(x: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax p = exp(x - lse) (B, A, V), entropy -sum(p * log p) (B, A))."""
    log_p = x - lse.unsqueeze(-1)
    p = log_p.exp()
    return p, -(p * log_p).sum(-1)


def _forward(x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse, lse


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, offset, temperature, with_entropy):
        x = window(logits, offset, tokens.shape[1], temperature)
        out, lse = _forward(x, tokens)
        if with_entropy:
            p, entropy = _entropy(x, lse)
        else:
            p, entropy = (x - lse.unsqueeze(-1)).exp(), out.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(p, tokens)
        ctx.offset, ctx.temperature, ctx.shape, ctx.dtype = offset, temperature, logits.shape, logits.dtype
        return out, entropy

    @staticmethod
    def backward(ctx, grad, _entropy_grad):
        p, tokens = ctx.saved_tensors
        # LogsumexpBackward: (-g) * exp(x - lse) (p, from the forward); GatherBackward: + g at the token
        # (0 + g + t == t + g bitwise)
        gx = (-grad).unsqueeze(-1) * p
        gx.scatter_add_(-1, tokens.unsqueeze(-1), grad.unsqueeze(-1))
        if ctx.temperature != 1.0:
            gx = gx / ctx.temperature  # DivBackward
        gx = gx.to(ctx.dtype)
        if tuple(gx.shape) == tuple(ctx.shape):
            return gx, None, None, None, None
        # SliceBackward: zeros outside the window; only those positions are filled, not the whole tensor
        end = ctx.offset + gx.shape[1]
        full = gx.new_empty(ctx.shape)
        full[:, : ctx.offset].zero_()
        full[:, end:].zero_()
        full[:, ctx.offset : end] = gx
        return full, None, None, None, None
