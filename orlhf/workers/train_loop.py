"""One worker's train step over its micro-batches (DeepSpeedWorker.train_micro_batches), with the counts every rank
must agree on: the micro-batch plan's length and each optimizer step's loss normalization (one all-reduce per step).

Invariants: every rank runs the same number of micro-batches and optimizer steps (equal shares, checked before any
collective, so a bad call raises everywhere instead of hanging); each micro-batch's loss is divided by its whole
step's real token and sequence counts over all ranks, so the step's gradient is the whole batch's mean loss.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional

import torch

from orlhf.algo.losses import LossNorm, step_norm
from orlhf.types import Experience, TrainStats
from orlhf.workers.batching import trim

if TYPE_CHECKING:
    from orlhf.workers.base import DeepSpeedWorker


def train_micro_batches(
    worker: DeepSpeedWorker, batch: Experience, loss_fn: Callable[[Experience, LossNorm], tuple[torch.Tensor, dict]]
) -> TrainStats:
    """Forward/backward/step over micro-batches of cfg.train.micro_train_batch_size; DeepSpeed applies the
    optimizer at each accumulation boundary (every train_batch_size / world samples on this rank).
    With --use_dynamic_batch (cfg.train.max_tokens) each step's samples are grouped by token budget instead
    (workers/micro_batches.py) and the worker marks the boundary itself (DeepSpeed runs with gas 1).

    Each micro-batch's loss is normalized by its optimizer step's LossNorm: the real action tokens and
    sequences of all the step's micro-batches on all ranks (one all-reduce per step), so the step's
    gradient is that of the whole batch's mean loss (orlhf/algo/losses.py). With cfg.trim_padding each
    micro-batch (kept in order) is trimmed to its real length first.
    `loss_fn(micro_batch, norm) -> (loss, stats)` where stats maps TrainStats field names (or extra keys)
    to scalars; they are averaged over micro-batches.
    """
    per_rank, n = worker.cfg.train.train_batch_size // worker.world_size, len(batch)
    # Checked on every rank before any collective, so a bad call raises everywhere instead of hanging.
    most, fewest = worker._max_over_ranks(n), -worker._max_over_ranks(-n)
    if most != fewest:
        raise ValueError(f"{worker.cfg.role} train_step: ranks got {fewest}..{most} samples; shares must be equal")
    if n == 0 or n % per_rank:
        raise ValueError(
            f"{worker.cfg.role} train_step got {n} samples per rank; expected a positive multiple "
            f"of train_batch_size / world = {per_rank} (whole optimizer steps)"
        )
    dynamic = bool(worker.cfg.train.max_tokens)
    micro, last = worker._train_plan(batch, per_rank)
    worker.engine.train()
    sums: dict[str, float] = {}
    grad_norm = 0.0
    for i, mb in enumerate(micro):
        if i == 0 or last[i - 1]:  # a step begins. DeepSpeed divides each loss by its configured gas
            gas = 1 if dynamic else per_rank // worker.cfg.train.micro_train_batch_size  # (1 when dynamic)
            masks = [x.action_mask for x in micro[i : last.index(True, i) + 1]]
            norm = step_norm_over_ranks(masks, gas, worker.world_size, worker.device)
        if dynamic:  # DeepSpeed reduces gradients and steps only where this says so
            worker.engine.set_gradient_accumulation_boundary(last[i])
        lr = worker.engine.get_lr()[0]  # the LR the coming optimizer step uses
        loss, stats = loss_fn(worker._to_device(trim(mb) if worker.cfg.trim_padding else mb), norm)
        worker.engine.backward(loss)
        boundary = worker.engine.is_gradient_accumulation_boundary()
        own_norm = plain_grad_norm(worker) if boundary else None
        worker.engine.step()
        if boundary:
            worker.after_optimizer_step()
        if boundary and worker.engine.was_step_applied():
            norm_value = worker.engine.get_global_grad_norm()
            norm_value = own_norm if norm_value is None else norm_value
            grad_norm = math.nan if norm_value is None else float(norm_value)
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    steps = len(micro)
    means = {k: v / steps for k, v in sums.items()}
    known = {k: means.pop(k) for k in list(means) if k in TrainStats.__dataclass_fields__}
    return TrainStats(lr=lr, grad_norm=grad_norm, micro_steps=steps, extra=means, **known)


def max_over_ranks(values: list[int], world_size: int, device) -> list[int]:
    """Each value's maximum over the ranks (one all-reduce; as they are on a single rank)."""
    if world_size == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def step_norm_over_ranks(masks: list[torch.Tensor], gas: int, world_size: int, device) -> LossNorm:
    """One optimizer step's LossNorm: token and sequence counts summed over its micro-batches and ranks."""
    local = step_norm(masks)
    counts = torch.tensor([local.tokens, local.seqs], dtype=torch.float64, device=device)
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    # DeepSpeed divides each micro-batch loss by gas and averages gradients over ranks: scale undoes both.
    return LossNorm(float(counts[0]), float(counts[1]), scale=float(gas * world_size))


def plain_grad_norm(worker: DeepSpeedWorker) -> Optional[float]:
    """Pre-clip gradient norm where DeepSpeed does not record one (ZeRO-0 in fp32: it clips and drops it).
    Gradients are already averaged over ranks here (ZeRO-0 all-reduces in backward at the boundary; one rank has
    nothing to average)."""
    if worker.zero_stage != 0 or worker.cfg.bf16:
        return None
    grads = [p.grad for p in worker.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
