"""Log-probs and entropy of chosen tokens from hidden states and the LM head, a chunk of tokens at a time, so the
(N, V) logits never exist whole: long responses on 150k-token vocabularies.

    hidden (N, H), weight (V, H), tokens (N,), chunk of C rows:
        forward   for each chunk: x = (h_c @ W^T).float() / T  (C, V) -> log p[token] = x[token] - lse(x),
                  entropy = -sum p log p; keeps h, lse, entropy (N values each), never x
        backward  for each chunk: x again (the same ops: the same values), p = exp(x - lse),
                  dx = g_lp * (onehot(token) - p) + g_H * (-p * (log p + H)),  then / T,
                  dh_c = dx @ W,  dW += dx^T @ h_c  (dW summed over chunks in float32)

Peak memory of this part: one float32 scratch block per call, allocated once and reused by every chunk: the
chunk's (C, V) logits, made log p and then dx in place, and an eighth of that beside them, where the passes that
need a second (C, V) tensor (logsumexp's exp(x - max), p, p log p) run slice by slice over the chunk's rows; plus
dW, one (V, H) float32 sum (added to in place for a float32 head). Against the whole (N, V) logits and the softmax
the unchunked backward keeps (algo/logprobs.py). One block, not one per chunk or per pass: no two chunks' buffers
are ever alive together, and a CPU process faults its pages in once per call, not once per chunk. Values: the
same dot products and element-wise ops as torch's logsumexp and log-softmax, so log-probs and entropy match the
unchunked path to float rounding; the weight's gradient is summed chunk by chunk in float32.
Entropy is differentiable here (an --entropy_loss_coef loss term) as well as logged.
"""

from __future__ import annotations

import torch

_SLICES = 8  # a chunk's element-wise passes (logsumexp, p, the entropy) run over this many slices of its rows


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


class _Scratch:
    """A call's float32 scratch block: x (C, V) for a chunk's logits, tmp (C / _SLICES, V) for one slice's
    temporaries; one allocation, freed with the object."""

    def __init__(self, n: int, rows: int, weight: torch.Tensor):
        c, v = min(rows, n), weight.shape[0]
        self.step = max(1, c // _SLICES)
        block = torch.empty((c + self.step) * v, dtype=torch.float32, device=weight.device)
        self.x, self.tmp = block[: c * v].view(c, v), block[c * v :].view(self.step, v)

    def logits(self, h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
        """(C, V) float32 logits of rows h / temperature, in x: what the LM head and the unchunked .float() give."""
        x = self.x[: h.shape[0]]
        if weight.dtype == torch.float32:
            torch.mm(h.to(weight.dtype), weight.t(), out=x)
        else:
            x.copy_(h.to(weight.dtype) @ weight.t())
        return x if temperature == 1.0 else x.div_(temperature)

    def slices(self, rows: int):
        """(start, end, tmp[:end - start]) over a chunk's rows, a slice at a time."""
        for a in range(0, rows, self.step):
            b = min(a + self.step, rows)
            yield a, b, self.tmp[: b - a]


def _logsumexp(x: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor) -> None:
    """out = logsumexp(x, -1), as torch.logsumexp computes it, with tmp (x's shape) for exp(x - max) instead of a
    temporary of its own."""
    m = x.amax(-1)
    m.masked_fill_(m.abs() == float("inf"), 0)
    torch.sub(x, m[:, None], out=tmp).exp_()
    torch.sum(tmp, -1, out=out)
    out.log_().add_(m)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, rows, with_entropy):
        n = hidden.shape[0]
        lp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_zeros(n, dtype=torch.float32)
        scratch = _Scratch(n, rows, weight)
        for s in range(0, n, rows):
            log_p = scratch.logits(hidden[s : s + rows], weight, temperature)  # x, made log p in place below
            for a, b, tmp in scratch.slices(log_p.shape[0]):
                _logsumexp(log_p[a:b], tmp, lse[s + a : s + b])
            log_p -= lse[s : s + rows, None]
            lp[s : s + rows] = log_p.gather(-1, tokens[s : s + rows, None]).squeeze(-1)
            if with_entropy:
                for a, b, tmp in scratch.slices(log_p.shape[0]):
                    torch.exp(log_p[a:b], out=tmp).mul_(log_p[a:b])  # p log p
                    torch.sum(tmp, -1, out=ent[s + a : s + b]).neg_()
        ctx.save_for_backward(hidden, weight, tokens, lse, ent)
        ctx.temperature, ctx.rows, ctx.with_entropy = temperature, rows, with_entropy
        ctx.set_materialize_grads(False)  # an output nobody differentiates gives None, and costs nothing
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tokens, lse, ent = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        if not ctx.with_entropy:
            g_ent = None
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        scratch = _Scratch(hidden.shape[0], rows, weight)
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]
            dx = scratch.logits(h, weight, t)
            dx -= lse[s : s + rows, None]  # log p, made dx in place slice by slice
            for a, b, p in scratch.slices(dx.shape[0]):
                log_p, r = dx[a:b], slice(s + a, s + b)
                torch.exp(log_p, out=p)
                if g_ent is not None:  # d(entropy)/dx = -p * (log p + H)
                    log_p += ent[r, None]
                    log_p *= p
                    log_p *= -g_ent[r, None]
                if g_lp is not None:  # d(log p[token])/dx = onehot(token) - p
                    p *= -g_lp[r, None]
                    p.scatter_add_(-1, tokens[r, None], g_lp[r, None])
                    if g_ent is not None:
                        log_p += p
                    else:
                        log_p.copy_(p)
                elif g_ent is None:
                    log_p.zero_()
            if t != 1.0:
                dx /= t
            dx = dx.to(weight.dtype)
            if grad_h is not None:
                grad_h[s : s + rows] = (dx @ weight).to(hidden.dtype)
            if grad_w is not None and weight.dtype == torch.float32:  # summed in place: no (V, H) product
                grad_w.addmm_(dx.t(), h.to(weight.dtype))
            elif grad_w is not None:
                grad_w += (dx.t() @ h.to(weight.dtype)).float()
            del dx  # a bfloat16 head's copy of dx: gone before the next chunk's
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None
