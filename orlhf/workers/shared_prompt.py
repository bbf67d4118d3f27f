"""Forwards that run each distinct prompt of a micro-batch once, however many samples share it.

GRPO-style runs draw n samples per prompt (--n_samples_per_prompt), so a micro-batch holds each prompt up to n
times. Under causal attention a prompt column's activations depend only on the columns before it, so the plain
forward computes the same prompt activations n times. Here:

    rows (B, T) = [pad.. prompt | response ..pad], T = P + A; the A action tokens are scored by columns P-1 .. T-2
    prompt_groups(batch) -> (U,) first row of each distinct prompt, (B,) each row's prompt, or None (all distinct)
    1. prefix pass     the U distinct prompts' columns 0 .. P-2, use_cache: each layer's keys and values (U, ...)
    2. spread          the cache's rows picked per row (B, ...): autograd adds the B rows' gradients back onto U
    3. response pass   columns P-1 .. T-2 of all B rows on top of that cache -> logits (B, A, V): exactly the
                       positions the plain forward scores, so every caller reads them as before (offset 0); the
                       critic's values (B, A) likewise, and the reward model's through column T-1 (its score
                       sits on each row's last real token)

The linear layers see U*(P-1) + B*A positions instead of B*T. The results are the plain forward's up to float
summation order (one prompt's products summed once instead of n times; gradients of its copies added by the index
backward).

A common head: chat templates start every prompt with the same tokens (a system prompt, the user turn's opening),
often most of a short prompt. When the U distinct prompts' real tokens begin with at least MIN_COMMON equal ones,
step 1 runs in two passes: the common head once (1 row), then each prompt's remainder on top of it (U rows, left-
padded among themselves); the cache then holds [head | remainder] columns with its own mask, and the response pass
reads it the same way. The linear layers see C + U*R + B*A positions (C the head, R the longest remainder).

When it does not apply (nothing shared, prompts of one column) the caller runs the plain forward. Whether a model
computes the same thing both ways is checked once per worker at init (`worker_shares_prompts`, on a small batch),
so a model whose cache does not follow transformers' DynamicCache contract falls back to the plain forward
instead of training on wrong numbers.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

import torch

from orlhf.types import SequenceBatch

log = logging.getLogger("orlhf.workers")


def prompt_groups(batch: SequenceBatch) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """((U,) index of the first row of each distinct prompt, (B,) index into those U for each row), or None when
    no two rows share their first P-1 prompt columns (tokens and padding alike) or the prompts have one column."""
    p = batch.sequences.shape[1] - batch.num_actions
    if p < 2 or len(batch) < 2:
        return None
    head = batch.sequences[:, : p - 1]
    key = torch.where(batch.attention_mask[:, : p - 1].bool(), head, torch.full_like(head, -1))  # padding as -1
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    u = int(inverse.max()) + 1
    if u == len(batch):
        return None
    rows = torch.arange(len(batch), device=inverse.device)
    first = torch.full((u,), len(batch), dtype=torch.long, device=inverse.device).scatter_reduce_(
        0, inverse, rows, "amin"
    )
    # order the distinct prompts by first appearance (torch.unique sorts them by value)
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u, device=order.device)
    return first[order], rank[inverse]


# run(input_ids, attention_mask, position_ids, cache or None for the first prompt pass, outputs wanted) ->
# (outputs (b, L, ...) or anything when not wanted, cache)
Run = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Optional[object], bool], tuple[Optional[torch.Tensor], Optional[object]]
]
MIN_COMMON = 8  # a common head shorter than this runs in each distinct prompt's row: one pass fewer


def shared_prompt_forward(
    run: Run,
    batch: SequenceBatch,
    position_ids: torch.Tensor,
    through_last: bool = False,
    around: Callable[[Callable], ContextManager] = lambda pick: nullcontext(),
    min_common: int = MIN_COMMON,
) -> Optional[torch.Tensor]:
    """(B, A, ...) outputs of columns P-1 .. T-2 (what scores the A action tokens; A+1 columns, through T-1, with
    through_last), computed with each distinct prompt's first P-1 columns run once; None where that does not
    apply: no prompt shared (prompt_groups), or the model returned no cache (e.g. gradient checkpointing in
    training, where transformers turns use_cache off). The caller then runs the plain forward.
    position_ids (B, T): the plain forward's positions. around(pick): a context each pass runs in, given how the
    pass takes its tokens from a (B, T, ...) tensor (workers/router_replay.py routed). min_common: the shortest
    common head run once for all distinct prompts (0: never)."""
    groups = prompt_groups(batch)
    if groups is None:
        return None
    first, spread = groups
    p = batch.sequences.shape[1] - batch.num_actions
    mask = batch.attention_mask
    cache, head_mask = _prompt_cache(run, batch, first, p, position_ids, around, min_common)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(spread)  # (U, ...) -> (B, ...) per layer
    end = batch.sequences.shape[1] if through_last else -1
    full = mask[:, :end] if head_mask is None else torch.cat([head_mask[spread], mask[:, p - 1 : end]], 1)
    with around(lambda x: x[:, p - 1 : end]):
        out, _ = run(batch.sequences[:, p - 1 : end], full, position_ids[:, p - 1 : end], cache, True)
    return out


def _prompt_cache(run: Run, batch: SequenceBatch, first, p: int, position_ids, around, min_common: int):
    """(cache of the U distinct prompts' first P-1 columns, its columns' mask (U, ...) or None where they are the
    batch's own columns 0 .. P-2). With a common head of >= min_common tokens (common_head), the head runs once
    and each prompt's remainder on top of it."""
    ids, mask = batch.sequences[first, : p - 1], batch.attention_mask[first, : p - 1]
    common = common_head(ids, mask) if min_common > 0 else 0
    if common == 0 or common < min_common or common == int(mask.sum(1).max()):  # short, or nothing after it
        with around(lambda x: x[first, : p - 1]):
            return run(ids, mask, position_ids[first, : p - 1], None, False)[1], None
    start = (mask.shape[1] - mask.sum(1)).long()  # each prompt's first real column (left padding)
    rest = mask.sum(1).long() - common  # each prompt's real columns after the head
    r = int(rest.max())
    slot = torch.arange(r, device=ids.device)
    pad = slot[None, :] < (r - rest)[:, None]  # (U, R): a remainder left-padded to R slots
    cols = torch.where(pad, start[:, None], start[:, None] + common + slot[None, :] - (r - rest)[:, None])
    head_cols = slice(int(start[0]), int(start[0]) + common)
    with around(lambda x: x[first[:1], head_cols]):
        _, cache = run(ids[:1, head_cols], mask[:1, head_cols], position_ids[first[:1], head_cols], None, False)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None, None
    cache.batch_select_indices(torch.zeros(len(first), dtype=torch.long, device=ids.device))  # (1, ...) -> (U, ...)
    head_mask = torch.cat([mask.new_ones(len(first), common), (~pad).to(mask.dtype)], 1)
    with around(lambda x: x[first[:, None], cols]):
        _, cache = run(ids.gather(1, cols), head_mask, position_ids[first].gather(1, cols), cache, False)
    return cache, head_mask


def common_head(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many real tokens every row of left-padded (U, L) prompts begins with (0 for fewer than 2 rows, or where
    a row's padding is not all on its left)."""
    if len(ids) < 2:
        return 0
    lengths = mask.sum(1).long()
    n = int(lengths.min())
    if not bool((mask.flip(1).cumprod(1).sum(1) == lengths).all()):  # a zero among a row's real columns
        return 0
    starts = (mask.shape[1] - lengths).tolist()
    heads = torch.stack([ids[i, s : s + n] for i, s in enumerate(starts)])  # (U, n): each row's first n real tokens
    same = (heads == heads[:1]).all(0).long()
    return int(same.cumprod(0).sum())


def same_as_plain(
    plain: Callable[[SequenceBatch], torch.Tensor],
    shared: Callable[[SequenceBatch], torch.Tensor],
    vocab_size: int,
    device: torch.device,
    float32: bool,
) -> bool:
    """Do both give the same (B, A, ...) outputs (logits, values, scores) at the real action positions of small
    batches (check_batches: with and without a common head)? `shared` returns
    None where it did not run shared (e.g. the model kept no cache): a no. Run without gradients; the caller puts
    the model in eval mode.

    Tolerance: float rounding of the two summation orders, relative to the outputs' own size; a wrong position or
    mask moves them by the order of their spread between positions, far above it."""
    return all(_same_on(plain, shared, batch, float32) for batch in check_batches(vocab_size, device))


def check_batches(vocab_size: int, device: torch.device) -> list[SequenceBatch]:
    """same_as_plain's small batches: 2 prompts of different lengths, left-padded, 2 samples each, one response
    shorter; in the second the prompts begin with a common head of MIN_COMMON tokens (the two-pass prompt)."""
    g = torch.Generator().manual_seed(0)
    lo = min(4, vocab_size - 1)  # ids above the usual special tokens
    out = []
    for head in (0, MIN_COMMON):
        p = head + 5  # prompt columns
        ids = torch.randint(lo, vocab_size, (4, p + 4), generator=g)
        mask = torch.ones(4, p + 4, dtype=torch.long)
        mask[2:, :2] = 0  # the second prompt is 2 columns shorter (left padding)
        ids[2:, 2 : 2 + head] = ids[0, :head]  # ... and begins with the first one's head
        ids[1, :p] = ids[0, :p]  # rows 0, 1 share prompt 0; rows 2, 3 share prompt 1
        ids[3, :p] = ids[2, :p]
        mask[3, -1] = 0  # one response ends a token early
        out.append(SequenceBatch(ids.to(device), mask.to(device), mask[:, p:].bool().to(device)))
    return out


def _same_on(plain, shared, batch: SequenceBatch, float32: bool) -> bool:
    with torch.no_grad():
        a, b = plain(batch), shared(batch)
    if b is None or a.shape != b.shape:
        return False
    real = batch.action_mask
    a, b = a[real].float(), b[real].float()
    tol = (1e-4 if float32 else 3e-2) * (1.0 + float(a.abs().max()))
    return bool(torch.isfinite(b).all()) and float((a - b).abs().max()) <= tol


def prompt_major_order(batch, generator: torch.Generator) -> torch.Tensor:
    """A random order of the rows that keeps each prompt's rows together, in their order: the distinct prompts
    are shuffled, not the rows. The controller's shuffle where the order cannot change the update (one optimizer
    step takes the whole batch), so training micro-batches hold whole prompts for the forward above."""
    groups = prompt_groups(batch)
    if groups is None:
        return torch.randperm(len(batch), generator=generator)
    spread = groups[1].cpu()
    u = int(spread.max()) + 1
    place = torch.empty(u, dtype=torch.long)
    place[torch.randperm(u, generator=generator)] = torch.arange(u)
    return torch.sort(place[spread], stable=True).indices


_verdicts: dict[tuple, bool] = {}  # worker_shares_prompts' checks made in this process, by check_key


def worker_shares_prompts(
    worker,
    plain: Callable[[SequenceBatch], torch.Tensor],
    shared: Callable[[SequenceBatch], torch.Tensor],
    kind: Optional[str] = None,
) -> bool:
    """Whether a model worker (workers/base.py) runs each distinct prompt once: asked for (not
    --no_shared_prompt), not packed, not ZeRO-3 over several ranks (the ranks' micro-batches would make different
    numbers of forward calls, each a round of collective parameter gathers), and `shared` gives what `plain`
    gives on a small batch (eval mode; collective-free, as ZeRO-3 then runs on one rank). Logged either way.

    kind: what `plain` and `shared` compute, named by the caller with anything else that changes their code path
    (e.g. the causal LM's logits, with or without router replay's hooks); given, a worker whose
    check_key matches one already checked in this process takes its verdict instead of checking again (the
    reference hosted in the actor's rank process, on CPU)."""
    cfg = worker.cfg
    if not cfg.shared_prompt or cfg.packing_samples or (worker.zero3 and worker.world_size > 1):
        return False
    key = None if kind is None else check_key(kind, worker)
    ok = _verdicts.get(key) if key is not None else None
    if ok is None:
        training = worker.engine.training
        worker.engine.eval()
        try:
            ok = same_as_plain(plain, shared, vocab_size(worker.module.config), worker.device, not cfg.bf16)
        finally:
            worker.engine.train(training)
        if key is not None:
            _verdicts[key] = ok
    log.info(
        "%s: %s",
        cfg.role,
        "each distinct prompt runs once per forward"
        if ok
        else "the model's cached forward differs from its plain one; every prompt runs in each sample's row",
    )
    return ok


def check_key(kind: str, worker) -> tuple:
    """What decides worker_shares_prompts' check: what is compared (kind), the model's class and whole config (its
    architecture, attention implementation and dtype), gradient checkpointing, the worker's precision, device and ZeRO
    stage. Not its weights: the check asks whether the model's cached forward computes what its plain one does, a
    property of the code that runs, which holds for any weights (the tolerance is relative to the outputs' size, and
    a wrong position or mask is far above it for any weights)."""
    import json

    module = worker.module
    config = module.config
    return (
        kind,
        f"{type(module).__module__}.{type(module).__qualname__}",
        json.dumps(config.to_dict(), sort_keys=True, default=str),
        str(getattr(config, "_attn_implementation", None)),
        bool(getattr(module, "is_gradient_checkpointing", False)),
        bool(worker.cfg.bf16),
        str(worker.device),
        bool(worker.zero3),
    )


def vocab_size(config) -> int:
    size = getattr(config, "vocab_size", None)
    return int(size if size is not None else config.get_text_config().vocab_size)
