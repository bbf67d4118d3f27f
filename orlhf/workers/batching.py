"""Padding removal for training and scoring batches: trim each micro-batch to its real length, or pack it.

A batch arrives padded to the whole step's longest prompt (left) and longest response (right):

    sequences (B, T) = [pad.. prompt | response ..pad]     T = P + A, actions = the last A columns

trim(mb)  drops the columns that are padding in every row of the micro-batch: the leading prompt columns no row
          uses and the trailing response columns no row reaches. (b, T') with T' <= T; action tensors (b, A').
          Results come back (b, A') and pad_actions() restores (b, A) with zeros. Exact: the same tokens, masks
          and positions, only all-padding columns removed. Scoring also sorts a rank's rows by length before
          cutting micro-batches (sort_by_length), so rows of similar length share a micro-batch.
pack(mb)  removes all padding: the micro-batch's real tokens in one row (1, N), positions restarting at 0 for each
          sample, and no attention mask: transformers then reads the sample boundaries from position_ids
          (flash-attn varlen on GPUs; a block-diagonal causal mask under SDPA/eager). `score_index` are the row
          positions whose outputs score the action tokens (the token before each), `last_index` each sample's
          last real token; unflatten() puts per-action outputs back into (b, A).

budget_micro_batches(lengths, budget)  (--use_dynamic_batch) groups samples by a token budget instead of a count:
          the number of groups is OpenRLHF's (first fit in the given order: the fewest bins it needs), then the
          samples are spread over that many groups longest first, each to the lightest group it fits in, so the
          groups carry similar token counts and none exceeds the budget. A sample longer than the budget alone is
          no error (as OpenRLHF): it gets a group of its own. Groups list sample indices in ascending order.

Training micro-batches keep their order (the same samples meet in a micro-batch as without trimming, so the
losses are the same numbers); only scoring, which is per sample, is reordered.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, TypeVar

import torch
import torch.nn.functional as F

# (B, T, ...); every other tensor field of 2 or more dims is per action (B, A)
SEQ_FIELDS = ("sequences", "attention_mask", "routing")

Batch = TypeVar("Batch")  # SequenceBatch or Experience


def real_lengths(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt lengths (B,), response lengths (B,)) counted over real tokens."""
    a = batch.num_actions
    prompt = batch.attention_mask[:, : batch.sequences.shape[1] - a].long().sum(-1)
    return prompt, batch.action_mask.long().sum(-1)


def trim(batch: Batch) -> Batch:
    """The batch without its all-padding columns (see the module docstring). Keeps >= 1 prompt and >= 1 action
    column, so `logits[:, -A'-1:-1]` still scores the actions."""
    t, a = batch.sequences.shape[1], batch.num_actions
    p = t - a
    used = batch.attention_mask[:, :p].bool().any(0)
    lead = min(int(used.long().argmax()), p - 1) if bool(used.any()) else p - 1
    acted = batch.action_mask.bool().any(0)
    a_keep = max(1, a - int(acted.flip(0).long().argmax())) if bool(acted.any()) else 1
    if lead == 0 and a_keep == a:
        return batch
    out = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            continue
        out[f.name] = v[:, lead : p + a_keep] if f.name in SEQ_FIELDS else v[:, :a_keep]
    return replace(batch, **out)


def pad_actions(t: torch.Tensor, num_actions: int) -> torch.Tensor:
    """(b, A', ...) -> (b, A, ...) with zeros on the right of dim 1."""
    missing = num_actions - t.shape[1]
    if missing <= 0:
        return t
    pad = [0, 0] * (t.dim() - 2) + [0, missing]
    return F.pad(t, pad)


def sort_by_length(batch, groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A permutation of the rows by real length (prompt + response), stable: rows of similar length become
    neighbours, so micro-batches cut from the sorted batch trim well.

    groups: (B,) group ids numbered in order of first appearance (rows of one prompt, workers/shared_prompt.py):
    a group's rows stay together, sorted by the group's longest row, so a forward that runs each prompt once
    finds its samples in one micro-batch."""
    prompt, response = real_lengths(batch)
    length = prompt + response
    if groups is None:
        return torch.sort(length, stable=True).indices
    n = int(groups.max()) + 1
    longest = torch.zeros(n, dtype=length.dtype).scatter_reduce_(0, groups, length, "amax")
    return torch.sort(longest[groups] * n + groups, stable=True).indices


@dataclass
class Packed:
    """A micro-batch as one row of real tokens (see the module docstring)."""

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long: 0.. within each sample
    score_index: torch.Tensor  # (M,) row positions scoring each real action token, samples in order
    action_rows: torch.Tensor  # (M,) which sample each of them belongs to
    action_cols: torch.Tensor  # (M,) its action column
    last_index: torch.Tensor  # (b,) row position of each sample's last real token
    batch_size: int
    num_actions: int

    def unflatten(self, values: torch.Tensor) -> torch.Tensor:
        """(M, ...) per-action values -> (b, A, ...), zeros where there is no action token."""
        out = values.new_zeros((self.batch_size, self.num_actions, *values.shape[1:]))
        out[self.action_rows, self.action_cols] = values
        return out


def pack(batch) -> Packed:
    """One row holding every real token of the batch, sample after sample."""
    mask = batch.attention_mask.bool()
    prompt, _ = real_lengths(batch)
    if bool((prompt < 1).any()):
        raise ValueError("pack: every sample needs a prompt token (the first action is scored from it)")
    lengths = mask.long().sum(-1)
    starts = lengths.cumsum(0) - lengths
    ids = batch.sequences[mask]  # row-major: each sample's real tokens in order, samples one after another
    positions = torch.arange(ids.numel(), device=ids.device) - torch.repeat_interleave(starts, lengths)
    rows, cols = batch.action_mask.bool().nonzero(as_tuple=True)  # responses are a prefix of the action columns
    return Packed(
        input_ids=ids.unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        score_index=starts[rows] + prompt[rows] + cols - 1,
        action_rows=rows,
        action_cols=cols,
        last_index=starts + lengths - 1,
        batch_size=len(batch),
        num_actions=batch.num_actions,
    )


def first_fit_bins(lengths: list[int], budget: int) -> int:
    """How many bins of `budget` tokens first fit fills with `lengths`, in order (OpenRLHF's count of dynamic
    micro-batches): [5, 3, 7, 2, 6] with 10 -> [8, 9, 6] -> 3."""
    bins: list[int] = []
    for n in lengths:
        for i, load in enumerate(bins):
            if load + n <= budget:
                bins[i] += n
                break
        else:
            bins.append(n)
    return len(bins)


def spread(lengths: list[int], budget: int, k: int) -> list[list[int]] | None:
    """`k` groups of sample indices, longest sample first into the lightest group where it fits (an empty group
    takes anything); None when some sample fits no group. Groups sorted by first index, indices ascending."""
    if not lengths:
        return []
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        g = min(range(k), key=lambda j: (loads[j], j))  # lightest: if it cannot take the sample, none can
        if groups[g] and loads[g] + lengths[i] > budget:
            return None
        groups[g].append(i)
        loads[g] += lengths[i]
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])


def fitting_count(lengths: list[int], budget: int, at_least: int = 1) -> int:
    """The fewest groups >= max(at_least, first_fit_bins) that spread() fills within the budget."""
    k = max(at_least, first_fit_bins(lengths, budget), 1)
    while spread(lengths, budget, k) is None:  # ends: with one sample per group every sample fits
        k += 1
    return k


def budget_micro_batches(lengths: list[int], budget: int, k: int | None = None) -> list[list[int]]:
    """Sample indices grouped by token budget (module docstring); k: the group count (fitting_count's value, or
    a larger one agreed between ranks)."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    k = fitting_count(lengths, budget) if k is None else k
    groups = spread(lengths, budget, min(k, len(lengths)))
    if groups is None:
        raise ValueError(f"{len(lengths)} samples do not fit {k} micro-batches of {budget} tokens")
    return groups
