"""The flag groups of what a run writes and how it runs: logging and checkpoints, evaluation during training, and the
runtime (device, Ray, timeouts, restarts). Part of TrainConfig (config/train_config.py), declared as its other groups
are (config/option.py)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from orlhf.config.option import opt

BEST_METRICS = ("reward_mean", "pass@1", "pass@k")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class LoggingConfig:
    use_wandb: Optional[str] = opt(
        None,
        "Log to Weights & Biases; optionally the API key (as in OpenRLHF). Offline with WANDB_MODE=offline.",
        metavar="KEY",
    )
    wandb_project: str = opt("orlhf", "wandb project.")
    wandb_run_name: Optional[str] = opt(None, "wandb run name (default: time-stamped).")
    wandb_org: Optional[str] = opt(None, "wandb entity (team or user) to log under.")
    wandb_group: Optional[str] = opt(None, "wandb group for this run.")
    use_tensorboard: Optional[str] = opt(
        None, "Log to TensorBoard; optionally the log folder (default: <save_path>/tensorboard).", metavar="DIR"
    )
    save_path: str = opt("./ckpt", "Run folder: metrics.jsonl, reward.png, the final model.")
    ckpt_path: Optional[str] = opt(None, "Checkpoint folder (default: <save_path>/checkpoints_ppo).")
    save_steps: int = opt(-1, "Checkpoint every N steps (-1: never).")
    logging_steps: int = opt(1, "Log every N steps.")
    max_ckpt_num: int = opt(3, "Checkpoints to keep.")
    max_ckpt_mem: Optional[float] = opt(
        None,
        "Disk budget for checkpoints in GiB (OpenRLHF's): after each save, the oldest others are deleted while they "
        "and the best checkpoint take more than this (the newest is never counted nor deleted). Default: none.",
        metavar="GIB",
    )
    load_checkpoint: bool = opt(
        False, "Resume from the newest complete checkpoint in --ckpt_path; start fresh when there is none yet."
    )
    use_ds_universal_ckpt: bool = opt(
        False,
        "With --load_checkpoint: resume a checkpoint whose actor/critic trained on another number of ranks. orlhf "
        "converts that role's DeepSpeed state to DeepSpeed's universal format itself (into "
        "<checkpoint>/<role>_universal, kept for later resumes) and loads it; OpenRLHF only loads one converted by "
        "hand with ds_to_universal.py. The same rank count loads as saved.",
    )
    save_hf_ckpt: bool = opt(False, "Also export HF-format model folders with checkpoints.")
    allow_no_checkpoint: bool = opt(
        False,
        "Kept for older orlhf scripts: --load_checkpoint now starts fresh when --ckpt_path holds no checkpoint, as "
        "in OpenRLHF.",
    )
    save_value_network: bool = opt(False, "Also save the final critic (value head included) in <save_path>/critic.")
    disable_ds_ckpt: bool = opt(
        False, "Checkpoints hold the HF actor folder only, no DeepSpeed state (smaller; a run cannot resume from them)."
    )
    ignore_disk_space: bool = opt(
        False, "Start even when the final model or one checkpoint cannot fit in its folder's free space (a warning)."
    )

    @property
    def checkpoint_dir(self) -> str:
        """--ckpt_path, else <save_path>/checkpoints_ppo: a run's checkpoints follow its run folder."""
        return self.ckpt_path if self.ckpt_path is not None else os.path.join(self.save_path, "checkpoints_ppo")


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training on held-out prompts (orlhf/trainer/evaluation.py)."""

    eval_dataset: Optional[str] = opt(None, "Held-out prompts (same formats and keys as --prompt_data).")
    eval_split: str = opt("train", "Split of a saved / hub dataset to evaluate on.")
    eval_steps: int = opt(-1, "Evaluate every N steps (-1: only after the last step, when --eval_dataset is set).")
    eval_temperature: float = opt(0.6, "Sampling temperature for evaluation.")
    eval_n_samples_per_prompt: int = opt(4, "Samples per eval prompt (k of eval/pass@k).")
    eval_before_train: bool = opt(
        False, "Evaluate once before the first step too (logged as step 0): where the eval curve starts."
    )
    best_metric_key: Optional[str] = opt(
        None,
        "Keep the checkpoint with the best eval metric in <ckpt_path>/best (never rotated out): reward_mean, "
        "pass@1 or pass@k; OpenRLHF's names work too (eval_default_pass1, '' for its pass@1, none for off).",
        metavar="METRIC",
    )

    @property
    def best_metric(self) -> Optional[str]:
        """--best_metric_key as orlhf names it (reward_mean | pass@1 | pass@k), or None: no best checkpoint (not
        given, `none`, or OpenRLHF's default '' without an --eval_dataset to pick a metric from). A key it cannot
        read raises ValueError (validation reports it first)."""
        key = self.best_metric_key
        if key is None or key.strip().lower() == "none":
            return None
        if key.strip() == "":  # OpenRLHF's default: the first pass1 metric of the evaluation, if there is one
            return "pass@1" if self.eval_dataset is not None else None
        name = key.strip().removeprefix("eval/")
        if name in BEST_METRICS:
            return name
        match = re.fullmatch(r"eval_.+_pass(\d+)", name)  # OpenRLHF's eval_<dataset>_pass<k>
        if match and int(match.group(1)) == 1:
            return "pass@1"
        if match and int(match.group(1)) == self.eval_n_samples_per_prompt:
            return "pass@k"
        raise ValueError(
            f"--best_metric_key {key}: not an evaluation metric of this run; use reward_mean, pass@1 or pass@k "
            f"(k = --eval_n_samples_per_prompt {self.eval_n_samples_per_prompt}), OpenRLHF's eval_<dataset>_pass1 / "
            f"eval_<dataset>_pass{self.eval_n_samples_per_prompt}, or none"
        )


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = opt("auto", "cuda (NCCL) or cpu (gloo); auto: cuda when a GPU is visible.", choices=DEVICES)
    address: Optional[str] = opt(None, "Ray cluster address (default: the job's cluster, else a new local one).")
    socket_ifname: Optional[str] = opt(
        None,
        "Network interface every rendezvous (DeepSpeed, the weight sync, gloo and NCCL) uses on each host, as "
        "NCCL_SOCKET_IFNAME reads it (name prefixes, ^ to exclude, = for exact names); exported there as "
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME. Default: the interface of each host's route to the Ray head.",
    )
    ray_timeout_s: float = opt(600.0, "Longest wait on any Ray call or placement group before failing.")
    hang_timeout_s: float = opt(
        60.0,
        "A rank or engine whose process gives no answer to a health check for this long while one of its calls runs "
        "is hung and counted lost (replaced under --max_engine_restarts, a run restart under --max_restarts). The "
        "check runs beside every call, so a long step or a slow collective is not hung; a call that never ends in a "
        "live process is --ray_timeout_s's.",
    )
    stop_grace_s: float = opt(
        15.0,
        "After a first SIGTERM or Ctrl-C the step in progress (or its checkpoint, or the export) may finish for this "
        "long; past it the run stops with its newest checkpoint. The whole stop stays within this plus 15 s, inside "
        "a scheduler's usual 30 s before SIGKILL. 0: stop at once.",
    )
    verbose: bool = opt(False, "Show every library's and worker's output here (default: in <save_path>/logs/).")
    stop_after_steps: Optional[int] = opt(
        None,
        "End this invocation after N steps, saving a checkpoint there (schedule unchanged; resume later "
        "with --load_checkpoint).",
    )
    max_restarts: int = opt(
        2,
        "A lost process of the run (a trainer rank, or an engine --max_engine_restarts does not replace: its process "
        "died) restarts the run's groups and engines from the newest complete checkpoint of this run, or from the "
        "start without one, up to N times over the run; the steps after that checkpoint are trained again and logged "
        "once. 0: stop at the first, naming it.",
    )
