"""The slices a role's worker config holds on top of the common part (config/worker_config.py): how a trained model
learns (TrainSlice), the actor's and the critic's losses, a LoRA adapter, a value head. Frozen dataclasses, built from
the TrainConfig by worker_config.worker_config(), read by the workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.algo.is_correction import IsCorrection


@dataclass(frozen=True)
class TrainSlice:
    """How a trained model (actor, critic) learns. train_batch_size is global; each rank sees
    train_batch_size / world per optimizer step."""

    learning_rate: float
    lr_warmup_ratio: float = 0.0
    total_optimizer_steps: int = 1  # for the LR schedule
    train_batch_size: int = 0
    micro_train_batch_size: int = 1
    max_norm: float = 1.0
    adam_betas: tuple = (0.9, 0.95)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine_with_min_lr"
    min_lr_ratio: float = 0.1  # cosine_with_min_lr's floor, a share of the peak LR
    optim: str = "adam"  # adam | muon (DeepSpeed's Muon with an auxiliary AdamW: workers/optim.py)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    adam_offload: bool = False  # Adam states on host
    offload_states: bool = False  # --deepspeed_enable_sleep: ZeRO-3 states leave the GPU in generation
    # --use_dynamic_batch: each optimizer step's samples in micro-batches of at most this many real tokens; 0: by
    # count (micro_train_batch_size)
    max_tokens: int = 0
    # --use_ds_universal_ckpt: a checkpoint of another rank count is converted to DeepSpeed's universal format and
    # loaded (workers/universal_ckpt.py); False: refused by name
    universal_ckpt: bool = False


@dataclass(frozen=True)
class PolicyLossSlice:
    """The actor's PPO loss: clipping, IS correction, entropy bonus and the KL loss."""

    loss_agg_mode: str = "token_mean"  # the policy term's (--actor_loss_agg_mode, else --loss_agg_mode)
    kl_entropy_agg_mode: Optional[str] = None  # the KL-loss and entropy terms' (--loss_agg_mode); None: loss_agg_mode
    eps_clip: float = 0.2  # the low side: ratio >= 1 - eps_clip
    eps_clip_high: Optional[float] = None  # the high side; None: eps_clip
    policy_loss_type: str = "ppo"
    is_level: str = "off"  # IS correction (algo/is_correction.py): off | token | seq
    is_mode: str = "mask"  # mask | clip
    is_gating: str = "ratio"  # ratio | binary_kl | tv
    is_threshold: tuple = (0.5, 5.0)
    dual_clip: Optional[float] = None
    entropy_loss_coef: float = 0.0
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    kl_unbiased_gradient: bool = False
    aux_loss_coef: float = 0.0  # MoE router load-balancing loss, added per micro-batch (--aux_loss_coef)

    @property
    def is_spec(self) -> Optional[IsCorrection]:
        """The IS correction the loss applies, None when off."""
        if self.is_level == "off":
            return None
        return IsCorrection(self.is_level, self.is_mode, self.is_gating, tuple(self.is_threshold))

    @property
    def is_correction(self) -> Optional[str]:
        """Its name (tis, icepop, seq-mask-tis, else level/mode/gating), None when off."""
        spec = self.is_spec
        return None if spec is None else spec.name


@dataclass(frozen=True)
class ValueLossSlice:
    """The critic's clipped value loss."""

    loss_agg_mode: str = "token_mean"
    value_clip: Optional[float] = None


@dataclass(frozen=True)
class LoraSlice:
    """A LoRA adapter on a trained model (--lora_rank > 0): peft's LoraConfig fields, OpenRLHF's defaults."""

    rank: int
    alpha: int = 16
    target_modules: "str | tuple" = "all-linear"  # "all-linear" or module names
    dropout: float = 0.0
    load_in_4bit: bool = False


@dataclass(frozen=True)
class HeadSlice:
    """A value head (critic, reward model): its name and whether config.json's mean/std apply
    (inputs/head_files.py)."""

    value_head_prefix: str = "score"
    normalize_reward: bool = False
