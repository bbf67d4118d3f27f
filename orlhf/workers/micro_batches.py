"""How a worker cuts its share of a batch into micro-batches (pure planning; the worker runs them).

forward_plan(batch, ...)            -> (row order or None, sizes)   score / log-prob forwards
    by count (--micro_rollout_batch_size; sorted by length first with trim_padding), or by a real-token
    budget (--use_dynamic_batch --rollout_max_tokens_per_gpu)
train_plan(batch, per_rank, ...)    -> (micro-batches in order, whether each ends its optimizer step)
    by count (--micro_train_batch_size), or per step by a token budget (--train_max_tokens_per_gpu), the
    count of micro-batches per step agreed across ranks (`max_over_ranks`: ZeRO's collectives and the step
    boundary must line up), as OpenRLHF does
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from orlhf.types import Experience, SequenceBatch
from orlhf.workers.batching import budget_micro_batches, fitting_count, real_lengths, sort_by_length
from orlhf.workers.shared_prompt import prompt_groups


def forward_plan(
    batch: SequenceBatch, micro: int, trim_padding: bool, max_tokens: int = 0, keep_prompts: bool = False
) -> tuple[Optional[torch.Tensor], list[int]]:
    """(row order, None for as given; micro-batch sizes) for a forward pass over `batch`. keep_prompts: the
    sort keeps the rows of one prompt together (batching.sort_by_length; the worker runs each prompt once)."""
    if max_tokens:  # groups of at most the budget in real tokens
        prompt, response = real_lengths(batch)
        groups = budget_micro_batches((prompt + response).tolist(), max_tokens)
        return torch.tensor([i for g in groups for i in g], dtype=torch.long), [len(g) for g in groups]
    sizes = [min(micro, len(batch) - i) for i in range(0, len(batch), micro)]
    if not (trim_padding and len(batch) > micro):
        return None, sizes
    groups = prompt_groups(batch) if keep_prompts else None  # only where a sort happens
    return sort_by_length(batch, None if groups is None else groups[1]), sizes


def train_plan(
    batch: Experience, per_rank: int, micro: int, max_tokens: int, max_over_ranks: Callable[[list[int]], list[int]]
) -> tuple[list[Experience], list[bool]]:
    """(micro-batches in order, whether each ends its optimizer step)."""
    if max_tokens:
        steps = _budget_steps(batch, per_rank, max_tokens, max_over_ranks)
    else:
        fixed, gas = batch.split([micro] * (len(batch) // micro)), per_rank // micro
        steps = [fixed[i : i + gas] for i in range(0, len(fixed), gas)]
    micro_batches, last = [], []
    for step in steps:
        micro_batches += step
        last += [False] * (len(step) - 1) + [True]
    return micro_batches, last


def _budget_steps(
    batch: Experience, per_rank: int, budget: int, max_over_ranks: Callable[[list[int]], list[int]]
) -> list[list[Experience]]:
    """Each optimizer step's samples (per_rank of them, in order) in token-budget micro-batches, the same number
    of them on every rank."""
    prompt, response = real_lengths(batch)
    lengths = (prompt + response).tolist()
    chunks = [lengths[i : i + per_rank] for i in range(0, len(batch), per_rank)]
    counts = [0] * len(chunks)
    while True:  # the agreed count may need raising where a rank's spread cannot use it: repeat until stable
        agreed = max_over_ranks([fitting_count(c, budget, at_least=k) for c, k in zip(chunks, counts)])
        if agreed == counts:
            break
        counts = agreed
    return [
        [batch.index(torch.tensor([s * per_rank + j for j in g])) for g in budget_micro_batches(chunk, budget, k)]
        for s, (chunk, k) in enumerate(zip(chunks, counts))
    ]
