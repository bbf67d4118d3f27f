"""The optimizer of a trained model (actor, critic), chosen by device and offload flags.

    --adam_offload                      DeepSpeedCPUAdam   (Adam states on the host, stepped by the CPU op)
    --deepspeed_enable_sleep on CUDA    FusedAdam          (ZeRO-3's offload_states moves only its states)
    otherwise                           torch AdamW        (no compiled op needed)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch

from orlhf.worker_config import ActorConfig, CriticConfig

def make_optimizer(params: list, cfg: ActorConfig | CriticConfig) -> torch.optim.Optimizer:
    kind = optimizer_kind(cfg)
    t = cfg.train
    betas, decay = tuple(t.adam_betas), t.weight_decay  # --adam_betas, --l2
    if kind == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=t.learning_rate, betas=betas, weight_decay=decay,
                                adamw_mode=True)
    if kind == "FusedAdam":
        return _fused_adam(params, t.learning_rate, betas, decay)
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=betas, weight_decay=decay)


def optimizer_kind(cfg: ActorConfig | CriticConfig) -> str:
    """Which Adam a trained model gets: "DeepSpeedCPUAdam" | "FusedAdam" | "AdamW" (torch).

    --adam_offload: DeepSpeedCPUAdam (the states live on the host; DeepSpeed's offload_states then leaves them
    alone). --deepspeed_enable_sleep on CUDA: DeepSpeed's FusedAdam, because ZeRO-3's offload_states (DeepSpeed
    0.19.8, stage3.py) asserts the optimizer's class is exactly FusedAdam before moving Adam states. Otherwise
    torch's AdamW, which needs no compiled op (FusedAdam compiles with nvcc on first use).
    """
    if cfg.train.adam_offload:
        return "DeepSpeedCPUAdam"
    if cfg.device == "cuda" and cfg.train.offload_states:
        return "FusedAdam"
    return "AdamW"


def _fused_adam(params, lr: float, betas: tuple, weight_decay: float) -> torch.optim.Optimizer:
    try:
        from deepspeed.ops.adam import FusedAdam

        with _arch_list_deepspeed_parses():  # the op JIT-compiles here on first use
            return FusedAdam(params, lr=lr, betas=betas, weight_decay=weight_decay, adam_w_mode=True)
    except Exception as e:  # the op JIT-compiles with nvcc + ninja unless DeepSpeed was built with it
        raise RuntimeError(
            f"--deepspeed_enable_sleep needs DeepSpeed's FusedAdam (ZeRO-3's offload_states moves only its "
            f"states), and it failed to load: {e}. Install nvcc and ninja (the op compiles on first use, about a "
            "minute), or reinstall DeepSpeed with DS_BUILD_FUSED_ADAM=1; or add --adam_offload (Adam states on "
            "the host), or drop --deepspeed_enable_sleep.") from e


_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")


def deepspeed_arch_list(value: str) -> str | None:
    """TORCH_CUDA_ARCH_LIST written so DeepSpeed 0.19.8's JIT builder can read it, or None when it already can.

    torch accepts arch-specific suffixes ("9.0a" for sm_90a, "10.0f"); DeepSpeed's builder sorts the entries by
    int() of each dotted part and raises "invalid literal for int() with base 10: '0a'" (found on an H100 whose
    image sets TORCH_CUDA_ARCH_LIST=9.0a). Its ops use no arch-specific instructions, so the plain arch ("9.0")
    builds code that runs on the same GPUs. Entries it cannot read at all are left for DeepSpeed to report.
    """
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    out: list[str] = []
    changed = False
    for e in entries:
        m = _ARCH.fullmatch(e)
        plain = f"{m[1]}.{m[2]}{m[3] or ''}" if m else e
        changed |= plain != e
        if plain not in out:
            out.append(plain)
    return ";".join(out) if changed else None


@contextlib.contextmanager
def _arch_list_deepspeed_parses():
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = deepspeed_arch_list(old) if old else None
    if fixed is None:
        yield
        return
    logging.getLogger("orlhf").warning(
        "TORCH_CUDA_ARCH_LIST=%s: DeepSpeed's op builder cannot read arch suffixes; FusedAdam is compiled for %s "
        "(no arch-specific instructions in it; the same GPUs run it)", old, fixed)
    os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = old
