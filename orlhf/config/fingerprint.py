"""What a checkpoint is only valid under: every flag that changes a run's trajectory, by flag name.

Deny by default: every flag of config/train_config.py is in the fingerprint unless it is listed in FREE_ON_RESUME
with the reason it cannot change the numbers (where outputs go, how fast or in how much memory the same math runs).
So a flag added later is checked on resume until someone argues it free. Resuming with a fingerprinted flag changed
is refused with the list of differences (checkpoint_format.check_compatible): it would silently continue another run,
or rebuild the LR schedule from other --num_episodes / --max_epochs / --lr_warmup_ratio values. A flag argued free
later is ignored in older checkpoints' fingerprints too, so they stay resumable.

Python files the run executes (a --remote_rm_url reward_func file, an --agent_func_path file) are fingerprinted by
their contents too (sha256, read at each save and at the resume): the same path with an edited reward function is
another run, and the refusal names the file.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

if TYPE_CHECKING:
    from orlhf.config.train_config import TrainConfig

# Flags free to change between a checkpoint and its resume, each with why.
FREE_ON_RESUME: dict[str, str] = {
    **dict.fromkeys(
        (
            "save_path",
            "ckpt_path",
            "save_steps",
            "logging_steps",
            "max_ckpt_num",
            "load_checkpoint",
            "allow_no_checkpoint",
            "save_hf_ckpt",
            "use_wandb",
            "wandb_project",
            "wandb_run_name",
            "use_tensorboard",
            "lora_save_merged",
            "max_ckpt_mem",
        ),
        "where outputs go",
    ),
    "ignore_disk_space": "whether a run starts, never what it computes",
    "allow_slow_bf16": "whether a run starts, never what it computes (--bf16 itself is in the fingerprint)",
    "dataloader_num_workers": "no effect in orlhf (prompts are read into memory), accepted for OpenRLHF's scripts",
    **dict.fromkeys(
        (
            "stop_after_steps",
            "ray_timeout_s",
            "hang_timeout_s",
            "stop_grace_s",
            "address",
            "socket_ifname",
            "reward_timeout_s",
            "reward_retries",
            "max_engine_logprob_gap",
            "max_engine_restarts",
            "max_restarts",
        ),
        "when to stop or fail",
    ),
    **dict.fromkeys(
        (
            "eval_dataset",
            "eval_split",
            "eval_steps",
            "eval_temperature",
            "eval_n_samples_per_prompt",
            "eval_before_train",
            "best_metric_key",
        ),
        "evaluation reads the weights, never changes them",
    ),
    **dict.fromkeys(
        (
            "micro_rollout_batch_size",
            "micro_train_batch_size",
            "gradient_checkpointing",
            "gradient_checkpointing_use_reentrant",
            "overlap_comm",
            "adam_offload",
            "ref_reward_offload",
            "deepspeed_enable_sleep",
            "vllm_enable_sleep",
            "vllm_gpu_memory_utilization",
            "vllm_cpu_kv_cache_gb",
            "vllm_cpu_threads",
            "train_cpu_threads",
            "vllm_sync_bucket_mb",
            "vllm_sync_backend",
            "vllm_sync_with_ray",
            "vllm_sync_delta",
            "enforce_eager",
            "enable_prefix_caching",
            "packing_samples",
            "logprobs_chunk_mb",
            "no_trim_padding",
            "no_shared_prompt",
            "flash_attn",
            "colocate_actor_ref",
            "colocate_critic_reward",
            "colocate_all_models",
            "ref_own_process",
            "critic_own_process",
            "ref_num_nodes",
            "ref_num_gpus_per_node",
            "reward_num_nodes",
            "reward_num_gpus_per_node",
            "device",
        ),
        "memory, speed and placement of the same computation",
    ),
    # A trained role's rank count and ZeRO stage change where its state lives, not the math (the global batch is
    # --train_batch_size whatever the ranks; ZeRO partitions the same fp32 Adam). What its DeepSpeed files can be
    # loaded into is read from the checkpoint itself and checked before they load (storage/ds_layout.py): another
    # stage is refused by name, another rank count needs --use_ds_universal_ckpt.
    **dict.fromkeys(
        ("actor_num_nodes", "actor_num_gpus_per_node", "critic_num_nodes", "critic_num_gpus_per_node", "zero_stage"),
        "placement of the same computation; the checkpoint's own layout is checked when it loads",
    ),
    # How a checkpoint is read, not what the run computes: a run saved without it resumes with it (that is its use),
    # and a checkpoint saved after a universal resume is an ordinary one at the new rank count.
    "use_ds_universal_ckpt": "how a checkpoint is read",
}
# Flags naming files or folders: compared as absolute paths, so `./data.jsonl` and its full path match.
_PATH_FLAGS = ("pretrain", "reward_pretrain", "critic_pretrain", "prompt_data", "remote_rm_url")
# Flags naming python files the run executes: their contents are fingerprinted as well as their path.
_CODE_FLAGS = ("remote_rm_url", "agent_func_path")


def config_fingerprint(cfg: "TrainConfig") -> dict[str, Any]:
    """{"--flag": value} for every flag not in FREE_ON_RESUME, plus the critic's resolved init model. Values are
    JSON-able (tuples become lists) so a fingerprint read back from meta.json compares equal."""
    from orlhf.config.flags import flag_fields, flag_values

    out = settings_fingerprint(flag_values(cfg))
    from orlhf.config.roles import model_path

    critic_model = model_path(cfg, "critic") if cfg.has_critic else None
    out["critic model (--critic_pretrain, else --reward_pretrain, else --pretrain)"] = _abs(critic_model)
    for attr, flag, f, _typ in flag_fields():
        if flag in _CODE_FLAGS:
            digest = _code_digest(getattr(getattr(cfg, attr), f.name))
            if digest is not None:
                out[f"--{flag} file contents"] = digest
    return out


def settings_fingerprint(values: Mapping[str, Any]) -> dict[str, Any]:
    """{"--flag": value} for the flags of `values` ({flag name: value}: a config's, or the run folder's resolved
    config read back by provenance.read_resolved) not in FREE_ON_RESUME; paths absolute, tuples as lists."""
    out: dict[str, Any] = {}
    for flag, value in values.items():
        if flag in FREE_ON_RESUME:
            continue
        if flag in _PATH_FLAGS and value is not None:
            value = ",".join(_abs(v.strip()) for v in value.split(","))  # --prompt_data a,b: each source
        out[f"--{flag}"] = list(value) if isinstance(value, tuple) else value
    return out


def _code_digest(path: Optional[str]) -> Optional[str]:
    """ "sha256 <first 16 hex digits> of <absolute path>" for a local .py file; None for URLs and unset flags."""
    if path is None or not path.endswith(".py") or not os.path.isfile(os.path.expanduser(path)):
        return None
    with open(os.path.expanduser(path), "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    return f"sha256 {digest[:16]} of {_abs(path)}"


def _abs(path: Optional[str]) -> Optional[str]:
    if path is None or "://" in path or not os.path.exists(os.path.expanduser(path)):
        return path  # URLs and hub ids as given
    return os.path.abspath(os.path.expanduser(path))
