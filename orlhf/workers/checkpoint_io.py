"""DeepSpeed checkpoint I/O of one worker (trained roles); orlhf/storage/checkpoint.py owns the folder around it.

Loading reads every file through torch.load(weights_only=True) only: see _engine_for_checkpoints.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)
_MICRO_STEPS = "orlhf_micro_steps"  # DeepSpeed does not save engine.micro_steps; kept in its client_state


def save_worker_checkpoint(worker, folder: str) -> None:
    """Collective: write this model's training state into `folder` as a DeepSpeed checkpoint.

    `folder`/latest names the tag `global_step<N>`, whose files hold every rank's ZeRO partitions of parameters
    and optimizer states (ZeRO-0: rank 0's full copy), the LR scheduler and DeepSpeed's step counters; each rank
    adds its RNG states (rng_rank<r>.json/.safetensors). With a LoRA adapter only the trained tensors are saved (the
    frozen base weights are --pretrain's). Returns on every rank after all ranks wrote.
    """
    import torch.distributed as dist

    from orlhf.storage.checkpoint_state import rng_state, save_state

    engine = _engine_for_checkpoints(worker)
    tag = f"global_step{engine.global_steps}"
    engine.save_checkpoint(
        folder,
        tag=tag,
        client_state={_MICRO_STEPS: engine.micro_steps},
        save_latest=True,
        exclude_frozen_parameters=_has_adapter(worker),  # LoRA: the frozen base comes from --pretrain on resume
    )
    save_state(folder, f"rng_rank{worker.rank}", rng_state())
    extras = worker.checkpoint_extras() if hasattr(worker, "checkpoint_extras") else None
    if extras:  # the actor's EMA (workers/ema.py), on rank 0
        save_state(folder, f"extras_rank{worker.rank}", extras)
    if worker.world_size > 1:
        dist.barrier()


def load_worker_checkpoint(worker, folder: str) -> None:
    """Collective: restore what save_checkpoint wrote, right after init() and before any other call (ZeRO-3
    loads into the freshly partitioned model). Parameters, optimizer states, LR scheduler, DeepSpeed's step
    counters and this rank's RNG come back, so training continues as if never stopped.

    A checkpoint of another rank count (--use_ds_universal_ckpt) is converted to DeepSpeed's universal format and
    loaded from there (workers/universal_ckpt.py); storage/ds_layout.py says when, and refuses what cannot load,
    on every rank before any collective. Ranks the checkpoint had no RNG state for keep their seeded one.
    Reads with torch.load(weights_only=True) only (see _engine_for_checkpoints).
    """
    from orlhf.storage.checkpoint_format import CheckpointError
    from orlhf.storage.checkpoint_state import load_state, set_rng_state
    from orlhf.storage.ds_layout import UNIVERSAL, load_plan, read_layout

    layout = read_layout(folder)
    train = getattr(worker.cfg, "train", None)
    universal = bool(train and train.universal_ckpt)
    plan = load_plan(worker.cfg.role, layout, worker.world_size, worker.zero_stage, universal, folder)
    engine = _engine_for_checkpoints(worker)
    strict = not _has_adapter(worker)  # LoRA: the adapter's tensors only; the base is --pretrain's
    if plan == UNIVERSAL:
        from orlhf.workers.universal_ckpt import load_universal, universal_folder

        source = universal_folder(folder, layout.tag, worker.rank, worker.world_size)
        path, client = load_universal(engine, source, layout.tag, strict)
    else:
        path, client = engine.load_checkpoint(
            folder, tag=layout.tag, load_module_strict=strict, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if path is None:  # DeepSpeed only warns when it finds nothing; a resume must not go on from scratch
        raise CheckpointError(f"{folder}: DeepSpeed found no checkpoint under tag {layout.tag!r}")
    engine.micro_steps = int(client.get(_MICRO_STEPS, engine.micro_steps))
    if layout.ranks != worker.world_size:
        # DeepSpeed steps the optimizer where (micro_steps + 1) % gas == 0, and the saved count is whole steps of the
        # old rank count's micro-batches: whole steps of this one's keep the boundaries where they belong
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if worker.rank < layout.ranks:
        set_rng_state(load_state(folder, f"rng_rank{worker.rank}"))
    if hasattr(worker, "checkpoint_extras") and worker.checkpoint_extras() is not None:
        saved = os.path.exists(os.path.join(folder, f"extras_rank{worker.rank}.json"))
        try:
            worker.load_checkpoint_extras(load_state(folder, f"extras_rank{worker.rank}") if saved else None)
        except ValueError as e:
            raise CheckpointError(f"{folder}: {e}") from e
    moved = "" if layout.ranks == worker.world_size else f", saved by {layout.ranks} ranks ({plan})"
    log.info(
        "%s rank %d: resumed from %s (optimizer step %d%s)",
        worker.cfg.role,
        worker.rank,
        folder,
        engine.global_steps,
        moved,
    )


def _has_adapter(worker) -> bool:
    return getattr(worker.cfg, "lora", None) is not None


def _engine_for_checkpoints(worker):
    """The engine, with DeepSpeed's checkpoint I/O reading through torch.load(weights_only=True).

    DeepSpeed 0.19.8's TorchCheckpointEngine.load calls torch.load(weights_only=False), which would run any
    code pickled into a checkpoint file. Every file this engine reads goes through engine.checkpoint_engine,
    so swapping it for a subclass whose load() is checkpoint_state.safe_torch_load makes the whole load safe; saving
    is unchanged (the same torch.save).
    """
    if not worker.cfg.trainable:
        raise RuntimeError(f"{worker.cfg.role} is frozen: it has no training state to checkpoint")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = worker.engine.checkpoint_engine
    if type(current) is TorchCheckpointEngine:
        worker.engine.checkpoint_engine = _safe_checkpoint_engine_cls()(worker.engine._config)
    elif type(current) is not _safe_checkpoint_engine_cls():
        raise RuntimeError(
            f"unexpected DeepSpeed checkpoint engine {type(current).__name__}: orlhf loads "
            "checkpoints through TorchCheckpointEngine with weights_only=True only"
        )
    return worker.engine


@functools.lru_cache(maxsize=None)
def _safe_checkpoint_engine_cls() -> type:
    """DeepSpeed's TorchCheckpointEngine with load() = storage/checkpoint_state.safe_torch_load (weights_only=True)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from orlhf.storage.checkpoint_state import safe_torch_load

    class SafeLoadCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return safe_torch_load(path, map_location=map_location)

    return SafeLoadCheckpointEngine
