"""One DeepSpeed model on one rank: process group, engine construction, micro-batched forward and train step (its loop
in workers/train_loop.py), full weights (gathered in workers/full_weights.py).

A worker is a plain object (no Ray): `Worker(cfg)` in a process whose env has MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE and LOCAL_RANK, then `init()` on every rank at once. A Ray rank actor holds one and calls its methods.

    init():  process group (gloo on cpu, nccl on cuda) -> seed -> load HF model (partitioned at load under
             ZeRO-3) -> deepspeed.initialize (Adam from workers/optim.py + warm-up/cosine LR for trained
             roles; no optimizer, eval mode for frozen ones); Adam takes --adam_betas / --l2, the LR
             follows --lr_scheduler, DeepSpeed clips gradients at --max_norm

    save_checkpoint(folder) / load_checkpoint(folder): trained roles' DeepSpeed state + RNG, collective; the
             folder layout around them, commit and resume order are in orlhf/storage/checkpoint.py

Invariants
- ZeRO-3 forwards and GatheredParameters are collective: every rank must make the same calls in the same
  order. Forward helpers pad a rank's micro-batch count to the largest one (dummy forwards, results dropped),
  so uneven shares do not hang; train steps require equal shares (they would break gradient accumulation).
- Results leave a worker as float32 CPU tensors; inputs may arrive on CPU and are moved to `self.device` here.
- Frozen models under ZeRO-1/2 run as stage 0: those stages shard optimizer states and gradients only,
  which a frozen model does not have (as OpenRLHF's eval config).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from orlhf.algo.losses import LossNorm
from orlhf.config.worker_config import WorkerConfig
from orlhf.distributed.endpoints import endpoint
from orlhf.types import Experience, SequenceBatch, TrainStats
from orlhf.workers.batching import pad_actions, trim
from orlhf.workers.deepspeed_setup import (
    ds_config,
    enable_gradient_checkpointing,
    init_distributed,
    lr_factor,
    seed_everything,
    worker_device,
)
from orlhf.workers.full_weights import full_weight_groups, groups_meta, persistent_buffers
from orlhf.workers.loading import hf_zero3_loading
from orlhf.workers.micro_batches import forward_plan, train_plan
from orlhf.workers.optim import decay_groups, make_optimizer
from orlhf.workers.train_loop import max_over_ranks, train_micro_batches

log = logging.getLogger("orlhf.workers")


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted over real tokens only: prompts are left-padded, so row i starts later."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class DeepSpeedWorker:
    """Base of the four model workers. Subclasses implement `build_model()` (runs under hf_zero3_loading)."""

    # Causal LMs set it at init: forwards run each distinct prompt once (workers/shared_prompt.py), so scoring
    # keeps a prompt's rows in one micro-batch
    shared_prompt = False
    # offload_states' `params` while this worker's states are in host memory, else None (workers/base.py's save)
    states_away: Optional[bool] = None

    @property
    def shared_prompt_train(self) -> bool:
        """shared_prompt in training forwards too: not with gradient checkpointing, under which transformers runs
        training forwards without a cache."""
        return self.shared_prompt and not self.cfg.gradient_checkpointing

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.device = worker_device(cfg.device)
        self.engine = None  # deepspeed.DeepSpeedEngine after init()
        self.rank, self.world_size = 0, 1
        self._ds_config: dict = {}

    # ---- construction ----

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    @endpoint
    def init(self) -> None:
        """Collective: all ranks call it together."""
        import torch.distributed as dist

        init_distributed(self.cfg.device)
        import deepspeed

        if self.cfg.device == "cpu" and self.cfg.cpu_threads:
            torch.set_num_threads(self.cfg.cpu_threads)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        seed_everything(self.cfg.seed, self.cfg.full_determinism)  # --full_determinism: before any model
        self._ds_config = self.deepspeed_config()
        with hf_zero3_loading(self._ds_config):
            model = self.build_model()
        if self.cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model, self.cfg)  # reentrant with --gradient_checkpointing_use_reentrant
        if self.cfg.trainable:
            optimizer = self._make_optimizer(model)
            if optimizer is None:  # Muon: DeepSpeed builds it from its config, over our parameter groups
                self.engine, *_ = deepspeed.initialize(
                    model=model,
                    model_parameters=decay_groups(model.named_parameters(), self.cfg.train.weight_decay),
                    lr_scheduler=self._make_scheduler,
                    config=self._ds_config,
                    dist_init_required=False,
                )
            else:
                self.engine, *_ = deepspeed.initialize(
                    model=model,
                    optimizer=optimizer,
                    lr_scheduler=self._make_scheduler(optimizer),
                    config=self._ds_config,
                    dist_init_required=False,
                )
            if self.cfg.bf16:  # masters from the checkpoint's wider values, not its bf16 rounding
                self._seed_fp32_masters()
            if self.world_size == 1 and self.zero_stage == 0:
                # One rank has nothing to average. DeepSpeed would still flatten every gradient into a fresh bucket,
                # "all-reduce" it over itself and copy it back, on every optimizer step.
                self.engine.enable_backward_allreduce = False
        else:
            self.engine, *_ = deepspeed.initialize(model=model, config=self._ds_config, dist_init_required=False)
            self.engine.eval()
        log.info(
            "%s rank %d/%d ready: ZeRO-%d, %s, %.2fM params",
            self.cfg.role,
            self.rank,
            self.world_size,
            self._ds_config["zero_optimization"]["stage"],
            self.device,
            sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) / 1e6,
        )

    def _seed_fp32_masters(self) -> None:
        from orlhf.workers.fp32_masters import seed_fp32_masters

        seeded, total = seed_fp32_masters(self.engine, self.cfg.model_path)
        if self.rank == 0 and seeded:
            log.info(
                "%s: bf16 with fp32 master weights from the checkpoint's values (%d of %d)",
                self.cfg.role,
                seeded,
                total,
            )

    def deepspeed_config(self) -> dict:
        """The config deepspeed.initialize gets (after the process group is up: it needs the world size). A
        subclass may extend it (benchmarks/hybrid_worker.py adds DeepSpeed's "hybrid_engine" section)."""
        return ds_config(self.cfg, self.world_size)

    def _make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return make_optimizer(decay_groups(model.named_parameters(), self.cfg.train.weight_decay), self.cfg)

    def _make_scheduler(self, optimizer):
        t = self.cfg.train
        warmup = math.ceil(t.lr_warmup_ratio * t.total_optimizer_steps)
        total, kind, floor = t.total_optimizer_steps, t.lr_scheduler, t.min_lr_ratio
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, warmup, total, min_ratio=floor, kind=kind)
        )

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def zero_stage(self) -> int:
        return self._ds_config["zero_optimization"]["stage"]

    @property
    def zero3(self) -> bool:
        return self.zero_stage == 3

    # ---- forward and train loops ----

    def _to_device(self, batch):
        kw = {f: getattr(batch, f) for f in batch.__dataclass_fields__}
        return type(batch)(**{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})

    def _max_over_ranks(self, n: int) -> int:
        return self._max_over_ranks_list([n])[0]

    def forward_micro_batches(self, batch: SequenceBatch, fn: Callable[[SequenceBatch], torch.Tensor]) -> torch.Tensor:
        """fn over micro-batches of cfg.micro_forward_batch_size, results concatenated as float32 on CPU.

        Under ZeRO-3 ranks with fewer micro-batches run dummy forwards (collective parameter gathers).
        With cfg.trim_padding the rows are sorted by length first and each micro-batch is trimmed to its own
        longest prompt and response (orlhf/workers/batching.py); `fn` may then return (b, A') and results come back
        (B, A) in the input order, zeros on padding.
        """
        # inference_mode skips autograd's version counters and view tracking, values unchanged; not under ZeRO-3,
        # whose hooks assign gathered tensors to the parameters' .data
        with torch.no_grad() if self.zero3 else torch.inference_mode():
            result = self._forward_micro_batches(batch, fn)
        return result.clone() if result.is_inference() else result  # a plain tensor: callers may use it in autograd

    def _forward_micro_batches(self, batch: SequenceBatch, fn: Callable[[SequenceBatch], torch.Tensor]) -> torch.Tensor:
        order, sizes = forward_plan(
            batch,
            self.cfg.micro_forward_batch_size,
            self.cfg.trim_padding,
            self.cfg.forward_max_tokens,
            keep_prompts=self.shared_prompt,
        )
        rows = batch.index(order) if order is not None else batch
        parts = rows.split(sizes) if sizes else []
        n_calls = self._max_over_ranks(len(parts)) if self.zero3 else len(parts)
        dummy = _dummy_row(batch)
        outs = []
        for i in range(max(n_calls, 1)):
            real = i < len(parts)
            mb = parts[i] if real else dummy
            out = fn(self._to_device(trim(mb) if self.cfg.trim_padding else mb))
            out = pad_actions(out, batch.num_actions) if out.dim() >= 2 else out
            outs.append((out if real else out[:0]).float().cpu())
        result = torch.cat(outs)
        if order is None:
            return result
        unsorted = torch.empty_like(result)
        unsorted[order] = result
        return unsorted

    def train_micro_batches(
        self, batch: Experience, loss_fn: Callable[[Experience, LossNorm], tuple[torch.Tensor, dict]]
    ) -> TrainStats:
        """Forward/backward/step over this rank's micro-batches, each loss normalized by its optimizer step's
        LossNorm (workers/train_loop.py). `loss_fn(micro_batch, norm) -> (loss, stats)`."""
        return train_micro_batches(self, batch, loss_fn)

    def after_optimizer_step(self) -> None:
        """Called on every rank at each accumulation boundary, right after DeepSpeed's step (the actor's EMA)."""

    def _train_plan(self, batch: Experience, per_rank: int) -> tuple[list[Experience], list[bool]]:
        """(micro-batches in order, whether each ends its optimizer step): workers/micro_batches.py."""
        t = self.cfg.train
        return train_plan(batch, per_rank, t.micro_train_batch_size, t.max_tokens, self._max_over_ranks_list)

    def _max_over_ranks_list(self, values: list[int]) -> list[int]:
        return max_over_ranks(values, self.world_size, self.device)

    # ---- full weights ----

    def named_full_weights(
        self,
        to_cpu: bool = True,
        copy: bool = True,
        all_ranks: bool = False,
        checkpoint_format: bool = True,
        trained_only: bool = False,
    ) -> Iterator[list[tuple[str, Optional[torch.Tensor]]]]:
        """The full weights, one group of whole transformer blocks at a time. Collective under ZeRO-3; None tensors
        off rank 0 unless all_ranks (the contract and the flags: full_weights.full_weight_groups)."""
        return full_weight_groups(self, to_cpu, copy, all_ranks, checkpoint_format, trained_only)

    def checkpoint_groups_meta(self, trained_only: bool = False) -> list[list[tuple[str, str, tuple]]]:
        """(name, dtype, full shape) per group, exactly as named_full_weights(trained_only=...) yields them. Local,
        no gather."""
        return groups_meta(self.module, trained_only)

    @endpoint
    def state_dict_full(self) -> Optional[dict[str, torch.Tensor]]:
        """Rank 0: the full float32 state dict in HF names (parameters and persistent buffers); None elsewhere.
        Collective under ZeRO-3. Under bf16 these are the bf16 module weights upcast, not the fp32 masters."""
        out = {}
        for group in self.named_full_weights(checkpoint_format=False):
            out.update({n: t.float() for n, t in group if t is not None})
        if self.rank != 0:
            return None
        out.update({n: b.detach().float().cpu().clone() for n, b in persistent_buffers(self.module)})
        return out

    # ---- hybrid mode: give the device to the engines while they generate (--deepspeed_enable_sleep) ----

    @endpoint
    def offload_states(self, params: bool = True) -> bool:
        """Move ZeRO-3 parameters, gradients and optimizer states to host memory; params=False keeps the module's
        parameters on the device, so forwards and weight syncs still run (--async_train's sleep). False if there is
        nothing to do (CPU, or not ZeRO-3, where DeepSpeed has no offload_states)."""
        if self.cfg.device != "cuda" or not self.zero3:
            return False
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        include = None if params else [s for s in State if s != State.lp_params]
        self.engine.offload_states(include=include, pin_memory=True, non_blocking=False)
        self.states_away = params  # what a checkpoint's save brings back and sends away again
        return True

    @endpoint
    def reload_states(self) -> bool:
        if self.cfg.device != "cuda" or not self.zero3:
            return False
        self.engine.reload_states(non_blocking=False)
        self.states_away = None
        return True

    @endpoint
    def save_checkpoint(self, folder: str) -> None:
        """Collective: this model's training state as a DeepSpeed checkpoint (workers/checkpoint_io.py); offloaded
        states (--async_train --deepspeed_enable_sleep keeps them away between trainings) come back for it."""
        from orlhf.workers.checkpoint_io import save_worker_checkpoint

        away = self.states_away
        if away is not None:
            self.reload_states()
        save_worker_checkpoint(self, folder)
        if away is not None:
            self.offload_states(away)

    @endpoint
    def load_checkpoint(self, folder: str) -> None:
        """Collective: restore save_checkpoint's folder, right after init() (workers/checkpoint_io.py)."""
        from orlhf.workers.checkpoint_io import load_worker_checkpoint

        load_worker_checkpoint(self, folder)


def _dummy_row(batch: SequenceBatch) -> SequenceBatch:
    """A one-row batch with `batch`'s shapes, for padding forwards under ZeRO-3 and to shape an empty result.
    With image prompts it is the batch's first row, images and all, so a padding forward runs the vision tower
    too: ZeRO-3 gathers its parameters in every rank's forward alike."""
    if batch.vision is not None and len(batch) > 0:
        return batch.index(torch.tensor([0]))
    t, a = batch.sequences.shape[1], batch.num_actions
    return SequenceBatch(
        batch.sequences.new_zeros(1, t), batch.attention_mask.new_ones(1, t), batch.action_mask.new_ones(1, a)
    )
