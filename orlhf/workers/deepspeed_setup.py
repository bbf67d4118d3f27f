"""A rank's process and DeepSpeed engine set-up: the device, the process group, seeds, the LR schedule and the
DeepSpeed config dict a worker (workers/base.py) builds its engine from."""

from __future__ import annotations

import logging
import math
import os
import random

import torch

from orlhf.config.worker_config import WorkerConfig
from orlhf.workers.ds_arch import use_arch_list_deepspeed_reads

log = logging.getLogger("orlhf.workers")

MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak LR, as OpenRLHF's "cosine_with_min_lr"
_warned_cpu_param_offload = False


def worker_device(device: str) -> torch.device:
    """The one place a torch device is chosen: cuda:<LOCAL_RANK> or cpu."""
    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda' (resolved), got {device!r}")
    return torch.device("cpu")


def init_distributed(device: str) -> None:
    """Join the default process group from the env (no-op if this process already has one)."""
    os.environ.setdefault("DS_ACCELERATOR", device)
    import deepspeed
    import torch.distributed as dist

    if device == "cuda":
        use_arch_list_deepspeed_reads()  # before DeepSpeed JIT-builds an op (FusedAdam, inference kernels)
        torch.cuda.set_device(worker_device(device))
    if not dist.is_initialized():
        if device == "cpu":
            skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend loads its shm_comm op on every init_distributed, compiling it (slow) when it was
    not built at install. The op serves only DeepSpeed-inference's tensor-parallel all-reduce, which orlhf never
    calls (ZeRO's collectives go through torch.distributed/gloo), so the install skips it and so does this."""
    import importlib

    # importlib, not `import deepspeed.comm.torch as m`: that resolves the attribute `torch` of deepspeed.comm,
    # which is the real torch package (deepspeed.comm re-exports it).
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    ds_torch_comm.build_shm_op = lambda: None


def seed_everything(seed: int, full_determinism: bool = False) -> None:
    """Seed python, numpy and torch (every CUDA device too); with --full_determinism, enable_full_determinism() first
    (where OpenRLHF's strategy calls transformers.enable_full_determinism(seed), which seeds the same way)."""
    if full_determinism:
        enable_full_determinism()
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


# What --full_determinism sets in a rank's environment, before its first cuBLAS call (a worker's init, before any
# model is loaded): cuBLAS's fixed workspace, which torch's deterministic mode needs for CUDA matmuls (CUDA >= 10.2),
# and flash-attention's deterministic backward, which transformers reads at each call. transformers' helper, which
# OpenRLHF calls, also sets CUDA_LAUNCH_BLOCKING=1: that serializes kernel launches and changes no number (torch
# needed it for determinism before CUDA 10.2 only), so it is left out; its Ascend NPU variables do not apply.
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "FLASH_ATTENTION_DETERMINISTIC": "1"}


def enable_full_determinism() -> None:
    """Deterministic kernels in this process (--full_determinism): DETERMINISM_ENV, torch's deterministic
    algorithms (an op without a deterministic kernel raises instead of running a nondeterministic one), cuDNN's
    deterministic convolutions without autotuning."""
    os.environ.update(DETERMINISM_ENV)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def enable_gradient_checkpointing(model, cfg: WorkerConfig) -> None:
    """--gradient_checkpointing: recompute each layer's activations in the backward, through torch's non-reentrant
    checkpoint, or its reentrant one with --gradient_checkpointing_use_reentrant (as OpenRLHF passes use_reentrant)."""
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": cfg.gradient_checkpointing_use_reentrant}
    )


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, min_ratio: float = MIN_LR_RATIO, kind: str = "cosine_with_min_lr"
) -> float:
    """LR multiplier at optimizer step `step` (0-based): linear warm-up, then the decay `kind` (--lr_scheduler):

        cosine_with_min_lr  cosine down to min_ratio (OpenRLHF's default)     cosine  cosine down to 0
        linear              straight down to 0                               constant, constant_with_warmup  1
    Warm-up is (step + 1) / warmup, so the first step already moves the weights (HF's schedule starts at 0).
    Past `total_steps` the LR stays where the decay ended. `constant` has no warm-up (validation checks).
    """
    if step < warmup_steps and kind != "constant":
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    if kind == "linear":
        return 1.0 - progress
    floor = min_ratio if kind == "cosine_with_min_lr" else 0.0
    if kind not in ("cosine_with_min_lr", "cosine"):
        raise ValueError(f"unknown lr scheduler {kind!r}")
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def ds_config(cfg: WorkerConfig, world_size: int) -> dict:
    """The DeepSpeed config dict for this worker's slice."""
    zero, batch, clip = _train_sections(cfg, world_size) if cfg.trainable else _frozen_sections(cfg, world_size)
    # --grad_accum_dtype: trained models only, as OpenRLHF's train config (a frozen model accumulates nothing)
    accum = cfg.grad_accum_dtype if cfg.trainable else None
    return {
        **batch,
        **({"optimizer": muon_optimizer(cfg.train, cfg.device)} if cfg.trainable and cfg.train.optim == "muon" else {}),
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.bf16},
        **({"data_types": {"grad_accum_dtype": accum}} if accum is not None else {}),
        "gradient_clipping": clip,
        # ZeRO-Offload refuses a client (torch) optimizer unless this is off. With adam_offload we pass
        # DeepSpeedCPUAdam anyway; off, it cannot refuse the torch AdamW of a non-offloaded combination.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _train_sections(cfg: WorkerConfig, world_size: int) -> tuple[dict, dict, float]:
    """A trained model's (zero_optimization, batch sizes, gradient clipping): its optimizer's ZeRO knobs and the
    accumulation that makes --train_batch_size from micro-batches across ranks."""
    t = cfg.train
    per_step = t.micro_train_batch_size * world_size
    if t.train_batch_size <= 0 or t.train_batch_size % per_step:
        raise ValueError(
            f"{cfg.role}: train_batch_size {t.train_batch_size} must be a positive multiple of "
            f"micro_train_batch_size {t.micro_train_batch_size} x world size {world_size} = {per_step}; "
            f"change --train_batch_size or --micro_train_batch_size"
        )
    zero: dict = {"stage": cfg.zero_stage}
    if t.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.device == "cuda"}
    zero.update(_train_zero_knobs(cfg, world_size))
    if t.optim == "muon" and cfg.zero_stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed 0.19.8's ZeRO-3 refuses Muon with reduce-scatter
    batch = {
        "train_batch_size": t.train_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_train_batch_size,
        "gradient_accumulation_steps": t.train_batch_size // per_step,
    }
    if t.max_tokens:  # --use_dynamic_batch: the worker marks each step's last micro-batch itself
        batch = {"train_batch_size": world_size, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    return zero, batch, t.max_norm


def _frozen_sections(cfg: WorkerConfig, world_size: int) -> tuple[dict, dict, float]:
    """A frozen (forward-only) model's (zero_optimization, batch sizes, gradient clipping): ZeRO-3 or none, its
    parameters offloaded with --ref_reward_offload on CUDA, one forward micro-batch per step."""
    stage = 3 if cfg.zero_stage == 3 else 0
    zero: dict = {"stage": stage}
    if cfg.param_offload and stage == 3:
        if cfg.device == "cuda":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        else:
            _log_cpu_param_offload_once()
    mb = cfg.micro_forward_batch_size
    batch = {
        "train_batch_size": mb * world_size,
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": 1,
    }
    return zero, batch, 1.0  # no optimizer steps: DeepSpeed never clips here (the value frozen roles always had)


def muon_optimizer(t, device: str = "cuda") -> dict:
    """--actor_optim muon (OpenRLHF 0.11's --actor.optim muon): DeepSpeed builds its MuonWithAuxAdam from this
    section. Muon steps the 2-D weights at --actor_muon_lr with --actor_muon_momentum; the auxiliary AdamW steps the
    rest (embeddings, head, norms, biases) with the role's learning rate, betas and eps; the role's weight decay is
    the groups' (biases and norm weights exempt, as for Adam). `t`: the role's TrainSlice.

    On a CPU device the auxiliary AdamW is torch's (DeepSpeed's torch_adam): DeepSpeed's default there, FusedAdam,
    is a C++ op that ninja builds in every new environment before the first step (a minute or more on CPU)."""
    params = {
        "lr": t.muon_lr,
        "muon_lr": t.muon_lr,
        "adam_lr": t.learning_rate,
        "momentum": t.muon_momentum,
        "betas": list(t.adam_betas),
        "eps": t.adam_eps,
        "weight_decay": t.weight_decay,
    }
    return {"type": "Muon", "params": {**params, "torch_adam": True} if device == "cpu" else params}


def _train_zero_knobs(cfg: WorkerConfig, world_size: int) -> dict:
    """A trained model's ZeRO knobs, as OpenRLHF's train config sets them (frozen models get none, as its eval
    config): --overlap_comm turns on overlap_comm with contiguous gradient buffers (off on one rank otherwise, where
    they are only copies); --zpg N the ZeRO++ secondary
    partition within groups of min(N, world) ranks under ZeRO-3, the only stage that reads it. DeepSpeed clamps the
    group to the world itself; left out where that is one rank (nothing to partition, and DeepSpeed's group for it is
    one per process, which a second model in the same process could not create again)."""
    out: dict = {}
    if cfg.overlap_comm:
        out.update(overlap_comm=True, contiguous_gradients=True)
    elif world_size == 1 and cfg.zero_stage in (1, 2):
        # One rank: its gradients are the whole partition, and there is nothing to reduce. DeepSpeed's default
        # contiguous buffer only copies every gradient into a bucket and back on each micro-batch.
        out["contiguous_gradients"] = False
    hpz = min(cfg.zpg, world_size)
    if cfg.zero_stage == 3 and hpz > 1:
        out["zero_hpz_partition_size"] = hpz
    return out


def _log_cpu_param_offload_once() -> None:
    global _warned_cpu_param_offload
    if not _warned_cpu_param_offload:
        _warned_cpu_param_offload = True
        log.info("param_offload (--ref_reward_offload) is a no-op on CPU: parameters already live in host memory")
