"""The slice of the config each model worker gets (actor, critic, reference, reward): which model, how DeepSpeed
runs it and, for trained models, how it learns. Workers never see the TrainConfig tree; entry.py builds one
WorkerConfig per role with worker_config() and hands it to every rank of that role's group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.config import ROLES, PPOConfig, TrainConfig


@dataclass(frozen=True)
class WorkerConfig:
    """One model worker's slice: which model, how DeepSpeed runs it, and (for trained models) how it learns."""

    role: str  # actor | critic | ref | reward
    model_path: str
    device: str  # "cpu" or "cuda" (resolved, never "auto")
    zero_stage: int = 3
    bf16: bool = False
    gradient_checkpointing: bool = False
    flash_attn: bool = False
    adam_offload: bool = False  # trained models: Adam states on host
    offload_states: bool = False  # trained models, --deepspeed_enable_sleep: ZeRO-3 states leave the GPU in generation
    param_offload: bool = False  # frozen models (--ref_reward_offload): params on host between uses
    seed: int = 42
    micro_forward_batch_size: int = 16  # --micro_rollout_batch_size
    cpu_threads: int = 0  # CPU only: torch threads in this rank's process (0: leave Ray's OMP_NUM_THREADS)
    trim_padding: bool = True  # cut each micro-batch to its real length (not --no_trim_padding)
    packing_samples: bool = False  # one row of real tokens per micro-batch (--packing_samples)
    # Reward model and critic: the head's name and whether config.json's mean/std apply (workers/value_head.py).
    value_head_prefix: str = "score"
    normalize_reward: bool = False
    # Training (actor, critic). train_batch_size is global; each rank sees train_batch_size / world per step.
    learning_rate: float = 0.0
    lr_warmup_ratio: float = 0.0
    total_optimizer_steps: int = 1  # for the LR schedule
    train_batch_size: int = 0
    micro_train_batch_size: int = 1
    max_norm: float = 1.0
    adam_betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    lr_scheduler: str = "cosine_with_min_lr"
    # Losses. Actor: eps_clip(_high), dual_clip, entropy_loss_coef, use_kl_loss/kl_coef/kl_estimator, policy_loss_type,
    # IS correction. Critic: value_clip. Both: loss_agg_mode.
    loss_agg_mode: str = "token_mean"
    eps_clip: float = 0.2  # the low side: ratio >= 1 - eps_clip
    eps_clip_high: Optional[float] = None  # the high side; None: eps_clip
    policy_loss_type: str = "ppo"
    is_correction: Optional[str] = None  # None, or tis | icepop | seq-mask-tis
    is_threshold: tuple = (0.5, 5.0)
    dual_clip: Optional[float] = None
    entropy_loss_coef: float = 0.0
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    value_clip: Optional[float] = None
    temperature: float = 1.0  # logits are divided by it, as the engines sample with it
    # --use_dynamic_batch: micro-batches by real-token budget (orlhf/batching.py budget_micro_batches); 0: by count
    train_max_tokens: int = 0
    forward_max_tokens: int = 0

    @property
    def trainable(self) -> bool:
        return self.role in ("actor", "critic")


def resolved_loss_agg_mode(ppo: PPOConfig) -> str:
    """--loss_agg_mode as given, else OpenRLHF's choice: sequence mean for GSPO, token mean otherwise."""
    if ppo.loss_agg_mode is not None:
        return ppo.loss_agg_mode
    return "seq_mean" if ppo.policy_loss_type == "gspo" else "token_mean"


def worker_config(cfg: TrainConfig, role: str, device: str, total_optimizer_steps: int = 1) -> WorkerConfig:
    """The slice of `cfg` that a `role` worker needs. `device` is the resolved device ("cpu" or "cuda")."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    d, ds, ppo = cfg.data, cfg.deepspeed, cfg.ppo
    path = {
        "actor": d.pretrain,
        "ref": d.pretrain,
        "critic": d.critic_pretrain or d.reward_pretrain or d.pretrain,
        "reward": d.reward_pretrain,
    }[role]
    if path is None:
        raise ValueError(f"no model path for role {role!r}; resolve the demo paths first (entry.resolve_demo)")
    common = dict(
        role=role, model_path=path, device=device, zero_stage=ds.zero_stage, bf16=ds.bf16,
        gradient_checkpointing=ds.gradient_checkpointing, flash_attn=ds.flash_attn, seed=ppo.seed,
        micro_forward_batch_size=ppo.micro_rollout_batch_size, temperature=ppo.temperature,
        trim_padding=not ds.no_trim_padding, packing_samples=ds.packing_samples, cpu_threads=ds.train_cpu_threads,
        **dynamic_batch_budgets(ds),
    )
    heads = dict(value_head_prefix=d.value_head_prefix, normalize_reward=ppo.normalize_reward)
    if role == "ref":
        return WorkerConfig(**common, param_offload=ds.ref_reward_offload)
    if role == "reward":
        return WorkerConfig(**common, **heads, param_offload=ds.ref_reward_offload)
    train = dict(
        adam_offload=ds.adam_offload, offload_states=ds.enable_sleep, lr_warmup_ratio=ppo.lr_warmup_ratio,
        total_optimizer_steps=total_optimizer_steps, train_batch_size=ppo.train_batch_size,
        micro_train_batch_size=ppo.micro_train_batch_size, max_norm=ppo.max_norm, adam_betas=tuple(ppo.adam_betas),
        weight_decay=ppo.l2, lr_scheduler=ppo.lr_scheduler, loss_agg_mode=resolved_loss_agg_mode(ppo),
    )
    if role == "actor":
        low, high = ppo.eps_clip_low_high if ppo.eps_clip_low_high is not None else (ppo.eps_clip, ppo.eps_clip)
        return WorkerConfig(**common, **train, learning_rate=ppo.actor_learning_rate, eps_clip=low,
                            eps_clip_high=high, dual_clip=ppo.dual_clip, entropy_loss_coef=ppo.entropy_loss_coef,
                            use_kl_loss=ppo.use_kl_loss, kl_coef=ppo.init_kl_coef, kl_estimator=ppo.kl_estimator,
                            policy_loss_type=ppo.policy_loss_type,
                            is_correction=ppo.vllm_is_correction_type if ppo.enable_vllm_is_correction else None,
                            is_threshold=tuple(ppo.vllm_is_truncated_threshold))
    return WorkerConfig(**common, **train, **heads, learning_rate=ppo.critic_learning_rate,
                        value_clip=ppo.value_clip)


def dynamic_batch_budgets(ds) -> dict:
    """WorkerConfig's token budgets from the DeepSpeed flags: none without --use_dynamic_batch; the forward budget
    defaults to the training one (OpenRLHF's --rollout_max_tokens_per_gpu default)."""
    if not ds.use_dynamic_batch:
        return {}
    forward = ds.rollout_max_tokens_per_gpu if ds.rollout_max_tokens_per_gpu is not None else ds.train_max_tokens_per_gpu
    return {"train_max_tokens": ds.train_max_tokens_per_gpu, "forward_max_tokens": forward}
