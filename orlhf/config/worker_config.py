"""The slice of the config each model worker gets (actor, critic, reference, reward), one class per role.

Every role gets the common part, WorkerConfig: which model, on which device, how DeepSpeed runs it and how its
forwards are batched. On top of that, each role gets only the slices it reads (the shape of torchtitan's nested
per-component configs; the slices are config/worker_slices.py's):

    ActorConfig   + temperature, train (TrainSlice), loss (PolicyLossSlice), lora (LoraSlice or None), router_replay
    RefConfig     + temperature, param_offload
    CriticConfig  + head (HeadSlice), train (TrainSlice), loss (ValueLossSlice), lora (LoraSlice or None)
    RewardConfig  + head (HeadSlice), param_offload

So the reference has no optimizer or learning rate and the critic no eps_clip: a worker cannot read a flag that
does not apply to it. A training slice exists exactly for the roles config/roles.py marks `trains`. Workers never see
the TrainConfig tree: launch/run.py builds one config per role with worker_config() and hands it to every rank of that
role's group. role_config() builds one from flat field names (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

from orlhf.config.ppo_config import OPENRLHF_AGG_MODES, PPOConfig
from orlhf.config.roles import model_path
from orlhf.config.roles import role as role_spec
from orlhf.config.train_config import TrainConfig
from orlhf.config.worker_slices import HeadSlice, LoraSlice, PolicyLossSlice, TrainSlice, ValueLossSlice


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What every role's worker reads: the model, the device, DeepSpeed, forward batching. Build a role's config
    (the subclasses below), never this base alone."""

    role: ClassVar[str]
    model_path: str
    device: str  # "cpu" or "cuda" (resolved, never "auto")
    zero_stage: int = 3
    bf16: bool = False
    gradient_checkpointing: bool = False
    flash_attn: bool = False
    eager_attention: bool = False  # transformers' eager attention instead of SDPA (--eager_attention)
    seed: int = 42
    micro_forward_batch_size: int = 16  # --micro_rollout_batch_size
    cpu_threads: int = 0  # CPU only: torch threads in this rank's process (0: leave Ray's OMP_NUM_THREADS)
    trim_padding: bool = True  # cut each micro-batch to its real length (not --no_trim_padding)
    packing_samples: bool = False  # one row of real tokens per micro-batch (--packing_samples)
    logprobs_chunk_mb: float = 256.0  # causal LMs: log-probs a chunk of tokens at a time (--logprobs_chunk_mb)
    shared_prompt: bool = True  # causal LMs: each distinct prompt run once per forward (not --no_shared_prompt)
    # --use_dynamic_batch: forwards grouped by a real-token budget (orlhf/workers/batching.py budget_micro_batches);
    # 0: by count (--micro_rollout_batch_size)
    forward_max_tokens: int = 0
    experts_implementation: Optional[str] = None  # MoE experts' kernels in transformers (--experts_implementation)
    gradient_checkpointing_use_reentrant: bool = False  # torch's reentrant checkpointing (with gradient_checkpointing)
    full_determinism: bool = False  # deterministic kernels in this rank's process (deepspeed_setup.seed_everything)
    use_liger_kernel: bool = False  # Liger's kernels: causal LMs (actor, reference) only, as OpenRLHF (loading.py)
    vision: bool = False  # image prompts (--max_images_per_prompt > 0): forwards take the batch's image tensors
    freeze_visual_encoder: bool = False  # trained VLMs: only the language model and LM head train (loading.py)
    # Trained roles' DeepSpeed knobs (deepspeed_setup.ds_config; frozen roles ignore them, as OpenRLHF's eval config):
    overlap_comm: bool = False  # zero_optimization.overlap_comm + contiguous_gradients
    grad_accum_dtype: Optional[str] = None  # data_types.grad_accum_dtype: fp32 | bf16 | fp16; None: the model's
    zpg: int = 1  # ZeRO++ hierarchical partition size under ZeRO-3 (zero_hpz_partition_size; 1: off)

    @property
    def trainable(self) -> bool:
        return role_spec(self.role).trains


@dataclass(frozen=True, kw_only=True)
class ActorConfig(WorkerConfig):
    role: ClassVar[str] = "actor"
    temperature: float = 1.0  # logits are divided by it, as the engines sample with it
    train: TrainSlice
    loss: PolicyLossSlice = PolicyLossSlice()
    lora: Optional[LoraSlice] = None  # an adapter instead of full fine-tuning; also scores the reference
    ema_beta: Optional[float] = None  # --enable_ema: the moving average's beta (None: no average kept)
    router_replay: Optional[str] = None  # --router_replay R2 | R3: routers follow recorded experts; None: off


@dataclass(frozen=True, kw_only=True)
class RefConfig(WorkerConfig):
    role: ClassVar[str] = "ref"
    temperature: float = 1.0
    param_offload: bool = False  # --ref_reward_offload: params on host between uses


@dataclass(frozen=True, kw_only=True)
class CriticConfig(WorkerConfig):
    role: ClassVar[str] = "critic"
    head: HeadSlice = HeadSlice()
    train: TrainSlice
    loss: ValueLossSlice = ValueLossSlice()
    lora: Optional[LoraSlice] = None  # an adapter on the backbone; the value head trains whole


@dataclass(frozen=True, kw_only=True)
class RewardConfig(WorkerConfig):
    role: ClassVar[str] = "reward"
    head: HeadSlice = HeadSlice()
    param_offload: bool = False


ROLE_CONFIGS: dict[str, type[WorkerConfig]] = {c.role: c for c in (ActorConfig, RefConfig, CriticConfig, RewardConfig)}


def role_config(role: str, **fields) -> WorkerConfig:
    """A role's config from flat field names, each routed to the slice that holds it (tests, benchmarks).
    A field the role does not have (eps_clip for the critic, learning_rate for the reference) is a TypeError."""
    role_spec(role)  # ValueError for an unknown role
    cls = ROLE_CONFIGS[role]
    top = {f.name: f for f in dataclasses.fields(cls)}
    slices: dict[str, dict] = {}
    flat: dict = {}
    for name, value in fields.items():
        home = next((s for s in ("train", "loss", "head") if s in top and name in _slice_fields(cls, s)), None)
        if home is not None:
            slices.setdefault(home, {})[name] = value
        elif name in top and name not in ("train", "loss", "head"):
            flat[name] = value
        else:
            raise TypeError(f"the {role} config has no field {name!r}")
    if "train" in top:
        slices.setdefault("train", {}).setdefault("learning_rate", 0.0)
    return cls(**flat, **{s: _slice_type(cls, s)(**kw) for s, kw in slices.items()})


def _slice_type(cls: type, name: str) -> type:
    return {"train": TrainSlice, "head": HeadSlice, "loss": PolicyLossSlice if cls is ActorConfig else ValueLossSlice}[
        name
    ]


def _slice_fields(cls: type, name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(_slice_type(cls, name))}


def resolved_loss_agg_mode(ppo: PPOConfig, policy_term: bool = False) -> str:
    """--loss_agg_mode as given, else OpenRLHF's choice: sequence mean for GSPO, token mean otherwise. For the
    actor's policy term (policy_term) --actor_loss_agg_mode comes first, OpenRLHF 0.11.2's spellings read as ours."""
    if policy_term and ppo.actor_loss_agg_mode is not None:
        return OPENRLHF_AGG_MODES.get(ppo.actor_loss_agg_mode, ppo.actor_loss_agg_mode)
    if ppo.loss_agg_mode is not None:
        return ppo.loss_agg_mode
    return "seq_mean" if ppo.policy_loss_type == "gspo" else "token_mean"


def role_ranks(cfg: TrainConfig, role: str) -> int:
    """Ranks in `role`'s model group (its nodes x GPUs per node; on CPU one "GPU" is one rank)."""
    pl = cfg.placement
    return getattr(pl, f"{role}_num_nodes") * getattr(pl, f"{role}_num_gpus_per_node")


def zero_stage_for(cfg: TrainConfig, role: str) -> int:
    """The ZeRO stage `role` runs in this run (zero_stage_of with the role's group size and the run's device)."""
    return zero_stage_of(cfg, role, role_ranks(cfg, role), cfg.device)


def zero_stage_of(cfg: TrainConfig, role: str, ranks: int, device: str) -> int:
    """--zero_stage when given; else 3, except for a group of one rank. There ZeRO-3 partitions nothing (the one
    shard is the whole model) but still runs its per-module gather/release hooks on every forward and backward
    (benchmarks/probes/bench_zero_stage.py measures what they cost), and in fp32 ZeRO-1/2 keep a second fp32 copy
    of the weights and a gradient partition beside the gradients (8 bytes a parameter more) and copy every gradient
    through a bucket on every micro-batch. So one fp32 rank trains and scores with no ZeRO (workers/base.py also
    skips DeepSpeed's gradient all-reduce over the one rank). Kept at 3: --deepspeed_enable_sleep (DeepSpeed's
    offload_states path is ZeRO-3's) and a frozen model with --ref_reward_offload on GPUs (parameter offload is
    ZeRO-3 only). A one-rank trained group stays at 2 with --bf16 (without ZeRO, DeepSpeed's BF16_Optimizer holds an
    fp32 gradient copy on top of ZeRO-2's states: more memory, not less), --adam_offload (ZeRO-Offload),
    --grad_accum_dtype other than fp32, and Muon (DeepSpeed's MuonWithAuxAdam lives in ZeRO's optimizer)."""
    ds = cfg.deepspeed
    if ds.zero_stage is not None:
        return ds.zero_stage
    if ranks > 1:
        return 3
    if role_spec(role).trains:
        if ds.enable_sleep:
            return 3
        muon = getattr(cfg.optim, f"{role}_optim", "adam") == "muon"
        return 2 if ds.bf16 or ds.adam_offload or ds.grad_accum_dtype not in (None, "fp32") or muon else 0
    return 3 if ds.ref_reward_offload and device == "cuda" else 0


def worker_config(cfg: TrainConfig, role: str, total_optimizer_steps: int = 1) -> WorkerConfig:
    """The slice of a finished `cfg` (config/resolve.py: the device resolved, the demo's paths filled in) that a `role`
    worker needs."""
    role_spec(role)  # ValueError for an unknown role
    d, ds, ppo = cfg.data, cfg.deepspeed, cfg.ppo
    train_budget, forward_budget = dynamic_batch_budgets(ds)
    common = _common_fields(cfg, role, forward_budget)
    head = HeadSlice(value_head_prefix=d.value_head_prefix, normalize_reward=ppo.normalize_reward)
    if role == "ref":
        return RefConfig(**common, temperature=ppo.temperature, param_offload=ds.ref_reward_offload)
    if role == "reward":
        return RewardConfig(**common, head=head, param_offload=ds.ref_reward_offload)
    train = _train_fields(cfg, role, total_optimizer_steps, train_budget)
    agg = resolved_loss_agg_mode(ppo)
    lo = cfg.lora
    lora = LoraSlice(lo.lora_rank, lo.lora_alpha, lo.targets, lo.lora_dropout, lo.load_in_4bit) if lo.enabled else None
    if role == "actor":
        return ActorConfig(
            **common,
            temperature=ppo.temperature,
            train=TrainSlice(learning_rate=ppo.actor_learning_rate, **train),
            loss=_policy_loss(ppo, agg),
            lora=lora,
            ema_beta=ppo.ema_beta if ppo.enable_ema else None,
            router_replay=None if ppo.router_replay == "disabled" else ppo.router_replay,
        )
    return CriticConfig(
        **common,
        head=head,
        train=TrainSlice(learning_rate=ppo.critic_learning_rate, **train),
        loss=ValueLossSlice(loss_agg_mode=agg, value_clip=ppo.value_clip),
        lora=lora,
    )


def _common_fields(cfg: TrainConfig, role: str, forward_budget: int) -> dict:
    """WorkerConfig's fields for `role`: the model, the device, DeepSpeed, forward batching."""
    ds, ppo = cfg.deepspeed, cfg.ppo
    path = model_path(cfg, role)
    if path is None:
        raise ValueError(f"no model path for role {role!r}; finish the config first (resolve.finish_config)")
    return dict(
        model_path=path,
        device=cfg.device,
        zero_stage=zero_stage_for(cfg, role),
        bf16=ds.bf16,
        gradient_checkpointing=ds.gradient_checkpointing,
        flash_attn=ds.flash_attn,
        eager_attention=ds.eager_attention,
        seed=ppo.seed,
        micro_forward_batch_size=ppo.micro_rollout_batch_size,
        trim_padding=not ds.no_trim_padding,
        packing_samples=ds.packing_samples,
        logprobs_chunk_mb=ds.logprobs_chunk_mb,
        cpu_threads=ds.train_cpu_threads,
        forward_max_tokens=forward_budget,
        shared_prompt=not ds.no_shared_prompt,
        experts_implementation=ds.experts_implementation,
        gradient_checkpointing_use_reentrant=ds.gradient_checkpointing_use_reentrant,
        full_determinism=ds.full_determinism,
        use_liger_kernel=ds.use_liger_kernel and not role_spec(role).value_head,
        vision=cfg.data.max_images_per_prompt > 0,
        freeze_visual_encoder=cfg.data.freeze_visual_encoder and role_spec(role).trains,
        overlap_comm=ds.overlap_comm,
        grad_accum_dtype=ds.grad_accum_dtype,
        zpg=ds.zpg,
    )


def _train_fields(cfg: TrainConfig, role: str, total_optimizer_steps: int, train_budget: int) -> dict:
    """TrainSlice's fields but the learning rate: `role`'s own optimizer settings (--actor_max_norm, ...), the shared
    flags (--max_norm, ...) where it has none."""
    ds, ppo = cfg.deepspeed, cfg.ppo
    return dict(
        adam_offload=ds.adam_offload,
        offload_states=ds.enable_sleep,
        total_optimizer_steps=total_optimizer_steps,
        train_batch_size=ppo.train_batch_size,
        micro_train_batch_size=ppo.micro_train_batch_size,
        max_tokens=train_budget,
        universal_ckpt=cfg.logging.use_ds_universal_ckpt,
        **cfg.optim.of(role, ppo),
    )


def _policy_loss(ppo: PPOConfig, agg: str) -> PolicyLossSlice:
    """The actor's loss slice: --eps_clip_low_high when given, else --eps_clip on both sides; the IS correction
    in either spelling (PPOConfig.is_correction_choice); `agg` the shared aggregation, for the KL and entropy terms."""
    low, high = ppo.eps_clip_low_high if ppo.eps_clip_low_high is not None else (ppo.eps_clip, ppo.eps_clip)
    level, mode, gating = ppo.is_correction_choice()
    return PolicyLossSlice(
        loss_agg_mode=resolved_loss_agg_mode(ppo, policy_term=True),
        kl_entropy_agg_mode=agg,
        eps_clip=low,
        eps_clip_high=high,
        dual_clip=ppo.dual_clip,
        entropy_loss_coef=ppo.entropy_loss_coef,
        use_kl_loss=ppo.use_kl_loss,
        kl_coef=ppo.init_kl_coef,
        kl_estimator=ppo.kl_estimator,
        policy_loss_type=ppo.policy_loss_type,
        is_level=level,
        is_mode=mode,
        is_gating=gating,
        is_threshold=tuple(ppo.vllm_is_truncated_threshold),
        kl_unbiased_gradient=ppo.kl_unbiased_gradient,
        aux_loss_coef=ppo.aux_loss_coef,
    )


def dynamic_batch_budgets(ds) -> tuple[int, int]:
    """(training, forward) token budgets from the DeepSpeed flags: (0, 0) without --use_dynamic_batch; the forward
    budget defaults to the training one (OpenRLHF's --rollout_max_tokens_per_gpu default)."""
    if not ds.use_dynamic_batch:
        return 0, 0
    forward = (
        ds.rollout_max_tokens_per_gpu if ds.rollout_max_tokens_per_gpu is not None else ds.train_max_tokens_per_gpu
    )
    return ds.train_max_tokens_per_gpu, forward
