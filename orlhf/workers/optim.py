"""The optimizer of a trained model (actor, critic), chosen by device and offload flags.

    --adam_offload on CUDA              DeepSpeedCPUAdam   (Adam states on the host, stepped by the CPU op)
    --deepspeed_enable_sleep on CUDA    FusedAdam          (ZeRO-3's offload_states moves only its states)
    otherwise                           torch AdamW        (no compiled op needed; on a CPU device its fused kernel)

On a CPU device torch's AdamW runs its fused kernel (`fused=True`): one pass over parameters, gradients and both
moments, where its default (single-tensor) path makes a dozen passes over each; a step over a 135M-parameter actor
is memory-bound either way, so the passes are its cost. Same update up to float rounding.

On a CPU device --adam_offload keeps DeepSpeed's offload layout (its host copy of the fp32 master weights and Adam
states) with torch's AdamW: the states are on the host either way, and DeepSpeedCPUAdam's C++ op would first be
built by ninja in each new environment, a minute or more of compiling for no change in where anything lives.

--l2 (weight decay) applies to the weight matrices only: biases and norm weights are in a group without decay
(decay_groups; OpenRLHF's get_optimizer_grouped_parameters, matched by name the same way). Decaying a norm's
scale pulls it towards 0, which shrinks the activations rather than regularizing.
"""

from __future__ import annotations

from typing import Optional

import torch

from orlhf.config.worker_config import ActorConfig, CriticConfig

# A parameter whose name contains one of these gets no weight decay (OpenRLHF's list; substrings, so
# "input_layernorm.weight", "model.norm.weight" and "q_norm.weight" all match).
NO_DECAY_NAMES = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")


def decay_groups(named_params, weight_decay: float) -> list[dict]:
    """Trainable (name, param) pairs -> optimizer param groups: decayed weights, then biases and norm weights with
    weight_decay 0. Without decay one group of everything (the same optimizer as before --l2 existed); an empty
    group is left out."""
    trainable = [(n, p) for n, p in named_params if p.requires_grad]
    if weight_decay == 0:
        return [{"params": [p for _, p in trainable], "weight_decay": 0.0}]
    exempt = [any(nd in n for nd in NO_DECAY_NAMES) for n, _ in trainable]
    groups = [
        {"params": [p for (_, p), e in zip(trainable, exempt) if not e], "weight_decay": weight_decay},
        {"params": [p for (_, p), e in zip(trainable, exempt) if e], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def make_optimizer(params: list, cfg: ActorConfig | CriticConfig) -> Optional[torch.optim.Optimizer]:
    """`params`: parameters or param groups (decay_groups); a group's weight_decay wins over --l2. None for Muon:
    DeepSpeed builds it from its config (deepspeed_setup.muon_optimizer) with these groups."""
    kind = optimizer_kind(cfg)
    if kind == "Muon":
        return None
    t = cfg.train
    betas, decay, eps = tuple(t.adam_betas), t.weight_decay, t.adam_eps  # --adam_betas, --l2, --actor_adam_eps
    if kind == "DeepSpeedCPUAdam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=t.learning_rate, betas=betas, eps=eps, weight_decay=decay, adamw_mode=True)
    if kind == "FusedAdam":
        return _fused_adam(params, t.learning_rate, betas, decay, eps)
    fused = {"fused": True} if cfg.device == "cpu" else {}  # module docstring
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=betas, eps=eps, weight_decay=decay, **fused)


def optimizer_kind(cfg: ActorConfig | CriticConfig) -> str:
    """Which optimizer a trained model gets: "Muon" (--actor_optim muon) | "DeepSpeedCPUAdam" | "FusedAdam" |
    "AdamW" (torch).

    --adam_offload on CUDA: DeepSpeedCPUAdam (the states live on the host; DeepSpeed's offload_states then leaves
    them alone); on CPU torch's AdamW (module docstring). --deepspeed_enable_sleep on CUDA: DeepSpeed's FusedAdam,
    because ZeRO-3's offload_states (DeepSpeed 0.19.8, stage3.py) asserts the optimizer's class is exactly
    FusedAdam before moving Adam states. Otherwise torch's AdamW, which needs no compiled op (FusedAdam compiles
    with nvcc on first use).
    """
    if cfg.train.optim == "muon":
        return "Muon"
    if cfg.train.adam_offload and cfg.device == "cuda":
        return "DeepSpeedCPUAdam"
    if cfg.device == "cuda" and cfg.train.offload_states:
        return "FusedAdam"
    return "AdamW"


def _fused_adam(params, lr: float, betas: tuple, weight_decay: float, eps: float = 1e-8) -> torch.optim.Optimizer:
    try:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)
    except Exception as e:  # the op JIT-compiles with nvcc + ninja unless DeepSpeed was built with it
        raise RuntimeError(
            f"--deepspeed_enable_sleep needs DeepSpeed's FusedAdam (ZeRO-3's offload_states moves only its "
            f"states), and it failed to load: {e}. Install nvcc and ninja (the op compiles on first use, about a "
            "minute), or reinstall DeepSpeed with DS_BUILD_FUSED_ADAM=1; or add --adam_offload (Adam states on "
            "the host), or drop --deepspeed_enable_sleep."
        ) from e
