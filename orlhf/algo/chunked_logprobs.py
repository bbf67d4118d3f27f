"""Log-probs and entropy of chosen tokens from hidden states and the LM head, a chunk of tokens at a time, so the
(N, V) logits never exist whole: long responses on 150k-token vocabularies.

    hidden (N, H), weight (V, H), tokens (N,), chunk of C rows:
        forward   for each chunk: x = (h_c @ W^T).float() / T  (C, V) -> log p[token] = x[token] - lse(x),
                  entropy = -sum p log p; keeps h, lse, entropy (N values each), never x
        backward  for each chunk: x again (the same ops: the same values), p = exp(x - lse),
                  dx = g_lp * (onehot(token) - p) + g_H * (-p * (log p + H)),  then / T,
                  dh_c = dx @ W,  dW += dx^T @ h_c  (dW summed over chunks in float32)

Peak memory of this part: two (C, V) float32 buffers (the rest is computed in place), whatever N is, against the
whole (N, V) logits and the softmax the unchunked backward keeps (algo/logprobs.py). Values: the same dot products,
so log-probs and entropy match the unchunked path to float rounding; the weight's gradient is summed chunk by chunk
in float32.
Entropy is differentiable here (an --entropy_loss_coef loss term) as well as logged.
"""

from __future__ import annotations

import torch


def chunk_rows(vocab: int, chunk_mb: float) -> int:
    """Rows per chunk so that one chunk's float32 logits take about chunk_mb MiB (at least 1)."""
    return max(1, int(chunk_mb * 2**20) // (4 * vocab))


def chunked_log_probs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    rows: int,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (..., H), weight (V, H), tokens (...) -> (log p(token) (...), entropy (...)), float32, both
    differentiable in hidden and weight. entropy=False: not computed (zeros), as a scoring forward needs none."""
    shape = tokens.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    lp, ent = _Chunked.apply(flat, weight, tokens.reshape(-1), temperature, rows, entropy)
    return lp.view(shape), ent.view(shape)


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    x = (h.to(weight.dtype) @ weight.t()).float()  # (C, V): what the LM head and the unchunked .float() give
    return x if temperature == 1.0 else x / temperature


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, rows, with_entropy):
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n, dtype=torch.float32)
        for s in range(0, n, rows):
            log_p = _logits(hidden[s : s + rows], weight, temperature)  # (C, V) x, made log p in place below
            lse[s : s + rows] = torch.logsumexp(log_p, dim=-1)
            log_p -= lse[s : s + rows, None]
            lp[s : s + rows] = log_p.gather(-1, tokens[s : s + rows, None]).squeeze(-1)
            if with_entropy:
                p_log_p = log_p.exp()
                p_log_p *= log_p
                ent[s : s + rows] = -p_log_p.sum(-1)
        ctx.save_for_backward(hidden, weight, tokens, lse, ent)
        ctx.temperature, ctx.rows, ctx.with_entropy = temperature, rows, with_entropy
        ctx.set_materialize_grads(False)  # an output nobody differentiates gives None, and costs nothing
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, hidden.shape[0], rows):  # two (C, V) float32 buffers a chunk: log p, then p = dx
            h = hidden[s : s + rows]
            log_p = _logits(h, weight, t)
            log_p -= lse[s : s + rows, None]
            dx = log_p.exp()  # p
            if not ctx.with_entropy:
                g_ent = None
            if g_ent is not None:  # d(entropy)/dx = -p * (log p + H): built in log_p's buffer
                log_p += ent[s : s + rows, None]
                log_p *= dx
                log_p *= -g_ent[s : s + rows, None]
            if g_lp is not None:  # d(log p[token])/dx = onehot(token) - p
                dx *= -g_lp[s : s + rows, None]
                dx.scatter_add_(-1, tokens[s : s + rows, None], g_lp[s : s + rows, None])
            else:
                dx.zero_()
            if g_ent is not None:
                dx += log_p
            del log_p
            if t != 1.0:
                dx /= t
            dx = dx.to(weight.dtype)
            if grad_h is not None:
                grad_h[s : s + rows] = (dx @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (dx.t() @ h.to(weight.dtype)).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None
