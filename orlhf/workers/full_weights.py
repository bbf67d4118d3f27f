"""A worker's full weights, one group of whole transformer blocks at a time: what weight syncs, state dicts and
save_hf read from a (possibly ZeRO-3-sharded) model.

    module.named_parameters() --layer_groups()--> [[(name, param)], ...]   outside the blocks first, then one per block
        --full_weight_groups()--> per group: GatheredParameters (ZeRO-3) -> (checkpoint name, tensor) on rank 0
        --groups_meta()---------> per group: (checkpoint name, dtype, full shape), local, nothing gathered

Invariants
- full_weight_groups is collective under ZeRO-3: every rank iterates to the end, in the same order.
- groups_meta names exactly what full_weight_groups yields (same groups, names, order), so rank 0 can plan a
  sync without gathering; names go through workers/hf_names.py the same way in both.
"""

from __future__ import annotations

import functools
import re
from contextlib import nullcontext
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn

from orlhf.workers.hf_names import meta_group, to_checkpoint_names

if TYPE_CHECKING:
    from orlhf.workers.base import DeepSpeedWorker

# Parameters of one transformer block share a "<...>.layers.<i>." prefix (Llama, Qwen, Mistral; GPT-2 uses "h").
LAYER_PREFIX = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)\.")


def layer_groups(module: nn.Module, trained_only: bool = False) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by transformer block; everything outside the blocks in one group, first.
    trained_only: without the frozen ones (requires_grad False: --freeze_visual_encoder's vision tower)."""
    groups: dict[str, list] = {"": []}
    for name, p in module.named_parameters():
        if trained_only and not p.requires_grad:
            continue
        match = LAYER_PREFIX.match(name)
        groups.setdefault(match.group(1) if match else "", []).append((name, p))
    return [g for g in groups.values() if g]


def full_weight_groups(
    worker: DeepSpeedWorker,
    to_cpu: bool = True,
    copy: bool = True,
    all_ranks: bool = False,
    checkpoint_format: bool = True,
    trained_only: bool = False,
) -> Iterator[list[tuple[str, Optional[torch.Tensor]]]]:
    """Yield the full weights one group at a time: a group is whole transformer blocks' worth of
    (hf_name, tensor) (one block per group, plus one group of embeddings / final norm / head).

    Collective under ZeRO-3: every rank must iterate to the end (each group is gathered with
    GatheredParameters). Rank 0 gets detached copies in the module's dtype (on CPU unless to_cpu=False);
    other ranks get the same names with None tensors. Without ZeRO-3 every rank holds full weights, but the
    contract is the same (None off rank 0) so callers need no branch. copy=False yields the live (gathered)
    tensors, valid only until the generator resumes: for senders that use them at once (weight sync).
    all_ranks=True gives every rank the full tensors (CUDA IPC sync: each GPU serves its own engine).
    checkpoint_format (default): names and tensors as a checkpoint on disk has them, which is what engines
    load (workers/hf_names.py: fused runtime tensors split back per expert); False: the module's
    own names (what save_pretrained takes, as it converts itself). trained_only: the parameters that train
    (weight syncs with --freeze_visual_encoder: the engines loaded the frozen ones from the same folder).
    """
    import deepspeed

    convert = functools.partial(to_checkpoint_names, worker.module)
    for group in layer_groups(worker.module, trained_only):
        params = [p for _, p in group]
        ctx = deepspeed.zero.GatheredParameters(params) if worker.zero3 else nullcontext()
        with ctx:
            if worker.rank == 0 or all_ranks:
                full = [(n, p.data.detach().to("cpu" if to_cpu else p.device, copy=copy)) for n, p in group]
                yield convert(full) if checkpoint_format else full
            else:
                names = convert(meta_group(group)) if checkpoint_format else group
                yield [(n, None) for n, _ in names]


def groups_meta(module: nn.Module, trained_only: bool = False) -> list[list[tuple[str, str, tuple]]]:
    """(name, dtype, full shape) per group, exactly as full_weight_groups(trained_only=...) yields them. Local, no
    gather."""
    return [
        [(n, str(t.dtype), tuple(t.shape)) for n, t in to_checkpoint_names(module, meta_group(g))]
        for g in layer_groups(module, trained_only)
    ]


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) for buffers that belong in a state dict (not torch's non-persistent ones)."""
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{mod_name}.{name}" if mod_name else name), buf
