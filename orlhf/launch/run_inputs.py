"""What a run reads before anything starts (launch/run.py's read_inputs runs it in a thread while Ray starts): the
tokenizer, the prompts, the eval prompts, the reward file and the checkpoint to resume, each failing here with its
flag named, before any placement group, engine or model starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orlhf.config.train_config import TrainConfig
from orlhf.launch.preflight import check_lora_targets

log = logging.getLogger("orlhf")


@dataclass
class RunInputs:
    """What a run reads before anything starts (read_inputs), kept across restarts (launch/restart.py)."""

    checkpoints: Any
    tokenizer: Any
    prompts: list
    evaluator: Any
    resume_from: Optional[Path]
    resume_step: Optional[int]
    run_id: str
    reward: Any  # make_reward's source, None when the reward-model group scores


def read_inputs(cfg: TrainConfig, run_id: str, run_logs) -> RunInputs:
    """Tokenizer, prompts, eval prompts, the reward file, resume point: in a thread while Ray starts (run_locked;
    the tokenizer's import of transformers and torch is most of it); their errors are raised once Ray is up, before
    anything is placed, and Ray is shut down."""
    run_logs.route_transformers()  # first: it imports transformers, before anything here can log through it
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.storage.checkpoint import CheckpointManager

    check_lora_targets(cfg)
    lg = cfg.logging
    checkpoints = CheckpointManager(lg.checkpoint_dir, lg.max_ckpt_num, run_id, max_ckpt_mem=lg.max_ckpt_mem)
    tokenizer = load_tokenizer(cfg.data.pretrain)
    prompts = load_prompts(cfg, tokenizer, load_vision_processor(cfg))
    new_loader(cfg, prompts)  # its problems (too few prompts for a batch) fail here, before any model starts
    evaluator = make_evaluator(cfg, tokenizer)  # eval data problems fail here, before any model starts
    reward = make_reward(cfg)  # a reward file that does not import, or defines no reward_func, fails here
    resume_from, resume_step, run_id = resume_point(cfg, checkpoints, run_id)
    return RunInputs(checkpoints, tokenizer, prompts, evaluator, resume_from, resume_step, run_id, reward)


def resume_point(cfg: TrainConfig, checkpoints, run_id: str):
    """(checkpoint folder or None, its step or None, the run id). Resuming, the same run goes on: its checkpoints'
    run id (also on W&B), and metrics logged after its step are cut (those steps are trained again). A checkpoint
    written under other flags fails here, before anything starts."""
    resume_from = find_checkpoint(cfg, checkpoints)
    if resume_from is None:
        return None, None, run_id
    from orlhf.storage.checkpoint import read_meta

    meta = read_meta(resume_from)
    run_id = checkpoints.run_id = meta.get("run_id") or run_id
    return resume_from, int(meta["step"]), run_id


def load_vision_processor(cfg: TrainConfig):
    """--pretrain's processor when the run trains on image prompts (--max_images_per_prompt > 0), else None."""
    if cfg.data.max_images_per_prompt <= 0:
        return None
    from orlhf.inputs.images import load_processor

    return load_processor(cfg.data.pretrain)


def load_prompts(cfg: TrainConfig, tokenizer, processor=None) -> list:
    """--prompt_data (one source or a mix) -> formatted, tokenized Prompts; logs the start-up line
    "prompts: N of M used (...)". `processor`: load_vision_processor's (loaded by format_prompts when needed and
    not given)."""
    from orlhf.inputs.prompt_mix import load_prompt_mix
    from orlhf.inputs.prompts import format_prompts

    d, p = cfg.data, cfg.ppo
    rows = load_prompt_mix(
        d.prompt_data, d.prompt_data_probs, d.prompt_split, d.input_key, d.label_key, d.max_samples, p.seed
    )
    prompts, stats = format_prompts(rows, tokenizer, d, p.prompt_max_len, processor)
    log.info("%s", stats.summary())  # the summary starts with "prompts: " itself
    check_text_rows_fit(cfg, prompts)
    return prompts


def check_text_rows_fit(cfg: TrainConfig, prompts: list) -> None:
    """Image prompts on ZeRO-3 groups of several ranks need an image in every prompt: ZeRO-3 gathers the vision
    tower's parameters on every rank together, so one rank running a micro-batch of text prompts (no vision forward)
    while another runs the tower would wait forever."""
    from orlhf.inputs.prompts import DataError

    pl = cfg.placement
    ranks = max(pl.actor_num_nodes * pl.actor_num_gpus_per_node, pl.ref_num_nodes * pl.ref_num_gpus_per_node)
    if cfg.data.max_images_per_prompt <= 0 or cfg.deepspeed.zero_stage not in (None, 3) or ranks < 2:
        return
    text = [q for q in prompts if not q.images]
    if text:
        raise DataError(
            f"prompt row {text[0].index + 1} (and {len(text) - 1} more) has no image ({cfg.data.image_key!r}, "
            f"--image_key): under ZeRO-3 on {ranks} ranks every prompt of a vision-language run needs one; "
            "drop the text rows, or train on one rank per model or with --zero_stage 2."
        )


def find_checkpoint(cfg: TrainConfig, checkpoints):
    """--load_checkpoint: the newest complete checkpoint (checked against these flags), or None to start fresh (there
    is none yet: said in one line). Without it, a --ckpt_path that already holds checkpoints is refused when this
    run would save there."""

    checkpoints.cleanup_stale_tmp()
    saves = cfg.logging.save_steps > 0 or cfg.runtime.stop_after_steps is not None  # (it saves at the stop)
    if not cfg.logging.load_checkpoint:
        if saves:
            checkpoints.check_new_run()
        return None
    path = checkpoints.latest()
    if path is None:  # OpenRLHF's meaning: its scripts always pass the flag, so the first run starts fresh
        log.info("--load_checkpoint: no checkpoint in %s: starting fresh", checkpoints.root)
        if saves:
            checkpoints.check_new_run()
        return None
    check_compatible_naming_sources(path, cfg)
    from orlhf.storage.ds_layout import check_resume

    check_resume(path, cfg)  # each trained role's saved rank count and ZeRO stage against this run's (exit 2)
    return path


def make_evaluator(cfg: TrainConfig, tokenizer):
    """--eval_dataset: the held-out prompts and when to run them (orlhf/trainer/evaluation.py); None without it."""
    e = cfg.eval
    if e.eval_dataset is None:
        return None
    from orlhf.trainer.evaluation import Evaluator, load_eval_prompts

    return Evaluator(
        load_eval_prompts(cfg, tokenizer),
        e.eval_n_samples_per_prompt,
        e.eval_temperature,
        cfg.ppo.top_p,
        cfg.ppo.generate_max_len,
        cfg.ppo.seed,
        e.eval_steps,
        e.best_metric,
        before_train=e.eval_before_train,
    )


def make_reward(cfg: TrainConfig):
    if cfg.data.remote_rm_url is None:
        return None  # the reward-model group scores
    from orlhf.inputs.rewards import make_reward_source
    from orlhf.storage.logs import worker_log_path

    d = cfg.data
    return make_reward_source(
        d.remote_rm_url, d.reward_timeout_s, d.reward_retries, output_log=worker_log_path("reward_func")
    )


def new_loader(cfg: TrainConfig, prompts: list):
    """The prompt loader of an attempt, at the run's start (a resume sets its position: run_state.restore_run)."""
    from orlhf.inputs.prompt_loader import PromptLoader

    p = cfg.ppo
    return PromptLoader(prompts, p.rollout_batch_size, p.num_episodes, p.seed)


def check_compatible_naming_sources(path: Path, cfg: TrainConfig) -> None:
    """The checkpoint's flags against this run's (storage/checkpoint_format.check_compatible, which decides); on a
    refusal, where each of this run's differing values came from (flag, OpenRLHF spelling, demo preset, default,
    derived), read from the resolved configuration the checkpoint keeps (run_config.json)."""
    from orlhf.config.fingerprint import config_fingerprint
    from orlhf.config.provenance import read_resolved, resume_changes
    from orlhf.storage.checkpoint import read_meta
    from orlhf.storage.checkpoint_format import CheckpointError, check_compatible
    from orlhf.storage.run_folder import checkpoint_config

    try:
        check_compatible(read_meta(path), config_fingerprint(cfg), path)
    except CheckpointError as e:
        saved = checkpoint_config(path)
        changes = resume_changes(read_resolved(saved), cfg) if saved.is_file() else []
        if not changes:
            raise
        lines = "\n".join(f"  - {c}" for c in changes)
        raise CheckpointError(f"{e}\nThis run's values, and where each came from ({saved.name}):\n{lines}") from None
