"""Flags -> the finished config a run starts from, in one place:

    flags --parse_config--> TrainConfig --resolve_device--> --device auto becomes cuda or cpu (and the weight-sync
    backend follows it unless given) --validate, once--> ok | ConfigError(every problem; the CLI exits 2)
    --resolve_demo--> without --pretrain, the built-in demo's model, prompts and reward --> frozen, finished

Validation runs once, after the device is known, so the cpu/cuda rules (--flash_attn, --vllm_sync_backend nccl,
--vllm_tensor_parallel_size > 1 on a machine without a GPU) are checked against the device the run will use.
The demo is filled in after validation: its paths exist by construction, and building it (first run only) is
not worth doing for flags that fail. Everything downstream reads the device from TrainConfig.device.
"""

from __future__ import annotations

import dataclasses
import glob
import sys
from typing import Any, Optional

from orlhf.config.flags import parse_config
from orlhf.config.train_config import TrainConfig


def finish_config(
    flags: dict[str, Any], explicit: frozenset[str] | set[str] = frozenset(), build_demo: bool = True
) -> TrainConfig:
    """Flat flag values (by flag name; `explicit`: the ones the user gave) -> the finished config."""
    return finish(parse_config(flags, explicit), explicit, build_demo)


def finish(cfg: TrainConfig, explicit: frozenset[str] | set[str] = frozenset(), build_demo: bool = True) -> TrainConfig:
    """A parsed (not yet validated) config -> finished: device resolved, validated once, demo filled in.
    `explicit` (the flags the user gave) lets validation refuse a flag given without the one it needs.
    `build_demo` False (--print_config): the demo's paths where it is cached, without building it."""
    return resolve_demo(validated(cfg, explicit), build_demo)


def validated(
    cfg: TrainConfig, explicit: frozenset[str] | set[str] = frozenset(), device: Optional[str] = None, here: bool = True
):
    """The device resolved (`device`: the one a plan describes, else --device / this machine), then every rule
    checked against it: what train-ppo and `orlhf plan` both run, in this one order. `here`: the run would start on
    this machine (its packages are checked); False for a plan of another cluster. Raises ConfigError."""
    from orlhf.config.validation import validate

    cfg = resolve_device(cfg, device)
    validate(cfg, explicit, local_packages=here)
    return cfg


def resolve_device(cfg: TrainConfig, device: Optional[str] = None) -> TrainConfig:
    """--device auto -> cuda when torch sees a GPU, else cpu; `device` instead when the caller knows it (`orlhf
    plan` describing a cluster, tests). The weight-sync backend follows the device unless given. No validation."""
    device = device or cfg.runtime.device
    if device == "auto":
        device = "cpu" if no_gpu_device_files() else _torch_device()
    backend = cfg.vllm.sync_backend or ("nccl" if device == "cuda" else "gloo")
    return dataclasses.replace(
        cfg,
        runtime=dataclasses.replace(cfg.runtime, device=device),
        vllm=dataclasses.replace(cfg.vllm, sync_backend=backend),
    )


# Device files a GPU's driver needs for torch.cuda to see it: NVIDIA (/dev/nvidiactl, /dev/nvidia0, ...), Jetson
# (/dev/nvhost-*, /dev/nvmap), WSL2 (/dev/dxg), ROCm (/dev/kfd).
GPU_DEVICE_FILES = ("/dev/nvidia*", "/dev/nvhost*", "/dev/nvmap", "/dev/dxg", "/dev/kfd")


def no_gpu_device_files() -> bool:
    """True on a Linux machine without any GPU device file: torch.cuda.is_available() is False there (its driver
    cannot open a GPU), so --device auto resolves to cpu without importing torch on the driver's main thread before
    Ray's start (the inputs thread imports it beside Ray's start instead). Elsewhere: False (ask torch)."""
    return sys.platform == "linux" and not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES)


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_demo(cfg: TrainConfig, build: bool = True) -> TrainConfig:
    """Without --pretrain: the built-in demo's model, prompts and reward function (built once, cached; `build`
    False: where they are cached, built or not). Only unset paths are filled; a user's --prompt_data or
    --remote_rm_url / --reward_pretrain stays as given.
    """
    if not cfg.data.uses_demo:
        return cfg
    from orlhf.demo.builder import demo_paths, ensure_demo

    demo = ensure_demo() if build else demo_paths()
    d = cfg.data
    no_reward = d.remote_rm_url is None and d.reward_pretrain is None and d.agent_func_path is None
    data = dataclasses.replace(
        d,
        pretrain=str(demo.model),
        prompt_data=d.prompt_data or str(demo.prompts),
        remote_rm_url=str(demo.reward_fn) if no_reward else d.remote_rm_url,
    )
    return dataclasses.replace(cfg, data=data)
