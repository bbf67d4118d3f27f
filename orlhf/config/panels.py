"""Which task each flag belongs to, and which flags a first run needs: the one table that `orlhf train-ppo --help`
(first-run flags only), `--help-all` (every flag), `--print_config` and docs/flags.md are grouped by.

A panel lists its first-run flags first, each with the one-line help `--help` shows (None: the flag's own help is
one line already), then its other flags, which only `--help-all` shows (with their full help). The first six
panels are the first run's, in the order a person sets a run up; the rest follow in `--help-all`. A unit test
checks that every flag of config/train_config.py sits in exactly one panel. Nothing here imports torch or Typer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Panel:
    title: str
    first_run: dict[str, Optional[str]] = field(default_factory=dict)  # flag -> its one-line --help (None: own help)
    more: tuple[str, ...] = ()  # shown by --help-all only

    @property
    def flags(self) -> tuple[str, ...]:
        return (*self.first_run, *self.more)


# Flags of the train-ppo command that are not config fields (cli.py declares them).
COMMAND_FLAGS = ("print_config",)

PANELS: tuple[Panel, ...] = (
    Panel(
        "Model and data",
        {
            "pretrain": "Actor/reference model: an HF folder (default: the built-in tiny demo).",
            "prompt_data": "Prompts: .jsonl, .json, .parquet or a saved dataset folder.",
            "input_key": None,
            "label_key": None,
            "apply_chat_template": None,
            "prompt_max_len": None,
        },
        (
            "critic_pretrain",
            "prompt_data_probs",
            "prompt_split",
            "input_template",
            "max_samples",
            "prompt_overflow",
            "dataloader_num_workers",
        ),
    ),
    Panel(
        "Rewards",
        {
            "remote_rm_url": "Reward source: a .py file with reward_func, or an http(s) URL.",
            "reward_pretrain": "Reward model instead: an HF folder with a value head.",
            "agent_func_path": "Multi-turn agent: a .py file with AgentInstance and AgentExecutor.",
        },
        (
            "normalize_reward",
            "reward_clip_range",
            "value_head_prefix",
            "reward_timeout_s",
            "reward_retries",
            "overlong_buffer_len",
            "overlong_penalty_factor",
            "stop_properly_penalty_coef",
        ),
    ),
    Panel(
        "Algorithm",
        {
            "advantage_estimator": None,
            "n_samples_per_prompt": None,
            "num_episodes": None,
            "rollout_batch_size": None,
            "train_batch_size": None,
            "micro_train_batch_size": None,
            "micro_rollout_batch_size": None,
            "actor_learning_rate": None,
            "critic_learning_rate": None,
            "init_kl_coef": None,
            "use_kl_loss": None,
            "kl_estimator": None,
        },
        (
            "max_epochs",
            "lr_warmup_ratio",
            "kl_target",
            "kl_horizon",
            "gamma",
            "lambd",
            "eps_clip",
            "value_clip",
            "seed",
        ),
    ),
    Panel(
        "Rollout",
        {
            "vllm_num_engines": "vLLM engines that generate; 0: the actor's ranks generate.",
            "rollout_backend": "vllm (engines of their own) or trainer (the actor's ranks generate).",
            "generate_max_len": "Most new tokens per response.",
            "temperature": None,
            "async_train": None,
        },
        (
            "max_len",
            "top_p",
            "vllm_gpu_memory_utilization",
            "enforce_eager",
            "enable_prefix_caching",
            "async_queue_size",
            "vllm_generate_batch_size",
            "partial_rollout",
            "partial_rollout_tokens",
        ),
    ),
    Panel(
        "Placement and device",
        {
            "device": None,
            "actor_num_nodes": None,
            "actor_num_gpus_per_node": "GPUs per node for the actor (CPU: ranks); --critic_*, --ref_* alike.",
            "vllm_tensor_parallel_size": None,
            "colocate_all_models": "Every model and engine on the actor's GPUs (hybrid mode).",
            "bf16": "Train and score in bfloat16.",
        },
        (
            "critic_num_nodes",
            "critic_num_gpus_per_node",
            "ref_num_nodes",
            "ref_num_gpus_per_node",
            "reward_num_nodes",
            "reward_num_gpus_per_node",
            "colocate_actor_ref",
            "colocate_critic_reward",
            "address",
            "socket_ifname",
        ),
    ),
    Panel(
        "Output and logging",
        {
            "save_path": "Run folder: logs, metrics.jsonl, report, checkpoints, the final model.",
            "save_steps": None,
            "use_wandb": "Log to Weights & Biases (optionally the API key).",
            "use_tensorboard": "Log to TensorBoard (optionally the log folder).",
            "verbose": "Every library's and worker's output here (default: <save_path>/logs/).",
            "print_config": None,
        },
        (
            "ckpt_path",
            "max_ckpt_num",
            "max_ckpt_mem",
            "save_hf_ckpt",
            "save_value_network",
            "disable_ds_ckpt",
            "ignore_disk_space",
            "logging_steps",
            "wandb_project",
            "wandb_run_name",
            "wandb_org",
            "wandb_group",
        ),
    ),
    Panel(
        "Algorithm variants (DAPO, GSPO, ...)",
        more=(
            "policy_loss_type",
            "loss_agg_mode",
            "actor_loss_agg_mode",
            "eps_clip_low_high",
            "dual_clip",
            "entropy_loss_coef",
            "aux_loss_coef",
            "no_advantage_std_norm",
            "kl_unbiased_gradient",
            "freezing_actor_steps",
            "dynamic_filtering",
            "dynamic_filtering_reward_range",
        ),
    ),
    Panel(
        "Importance-sampling correction",
        more=(
            "enable_vllm_is_correction",
            "vllm_is_correction_type",
            "vllm_is_truncated_threshold",
            "is_correction_level",
            "is_correction_mode",
            "is_correction_gating",
        ),
    ),
    Panel("Mixture-of-experts routing", more=("router_replay",)),
    Panel(
        "Optimizer",
        more=(
            "lr_scheduler",
            "max_norm",
            "adam_betas",
            "l2",
            "enable_ema",
            "ema_beta",
            "actor_optim",
            "critic_optim",
            "actor_muon_lr",
            "critic_muon_lr",
            "actor_muon_momentum",
            "critic_muon_momentum",
        ),
    ),
    Panel(
        "Per-role optimizer",
        more=tuple(
            f"{role}_{name}"
            for name in (
                "max_norm",
                "adam_betas",
                "adam_eps",
                "weight_decay",
                "lr_scheduler",
                "lr_warmup_ratio",
                "min_lr_ratio",
            )
            for role in ("actor", "critic")
        ),
    ),
    Panel(
        "Weight sync",
        more=(
            "vllm_sync_backend",
            "vllm_sync_with_ray",
            "vllm_sync_delta",
            "vllm_sync_bucket_mb",
            "max_engine_logprob_gap",
        ),
    ),
    Panel(
        "Memory and speed",
        more=(
            "zero_stage",
            "gradient_checkpointing",
            "gradient_checkpointing_use_reentrant",
            "adam_offload",
            "ref_reward_offload",
            "deepspeed_enable_sleep",
            "vllm_enable_sleep",
            "packing_samples",
            "use_dynamic_batch",
            "train_max_tokens_per_gpu",
            "rollout_max_tokens_per_gpu",
            "logprobs_chunk_mb",
            "overlap_comm",
            "grad_accum_dtype",
            "zpg",
            "no_trim_padding",
            "no_shared_prompt",
        ),
    ),
    Panel(
        "Attention and kernels",
        more=("flash_attn", "eager_attention", "use_liger_kernel", "experts_implementation", "full_determinism"),
    ),
    Panel(
        "LoRA", more=("lora_rank", "lora_alpha", "target_modules", "lora_dropout", "load_in_4bit", "lora_save_merged")
    ),
    Panel("Vision-language models", more=("image_key", "max_images_per_prompt", "freeze_visual_encoder")),
    Panel(
        "Evaluation",
        more=(
            "eval_dataset",
            "eval_split",
            "eval_steps",
            "eval_temperature",
            "eval_n_samples_per_prompt",
            "eval_before_train",
            "best_metric_key",
        ),
    ),
    Panel(
        "Fault tolerance and resume",
        more=(
            "load_checkpoint",
            "use_ds_universal_ckpt",
            "allow_no_checkpoint",
            "stop_after_steps",
            "max_restarts",
            "max_engine_restarts",
            "hang_timeout_s",
            "ray_timeout_s",
            "stop_grace_s",
        ),
    ),
    Panel(
        "CPU runs",
        more=(
            "ref_own_process",
            "critic_own_process",
            "vllm_cpu_kv_cache_gb",
            "vllm_cpu_threads",
            "train_cpu_threads",
            "allow_slow_bf16",
        ),
    ),
)

PANEL_OF: dict[str, str] = {flag: p.title for p in PANELS for flag in p.flags}
FIRST_RUN: dict[str, Optional[str]] = {flag: line for p in PANELS for flag, line in p.first_run.items()}


def ordered_flags() -> list[str]:
    """Every flag in --help-all order: panel by panel, each panel's first-run flags first."""
    return [flag for p in PANELS for flag in p.flags]
