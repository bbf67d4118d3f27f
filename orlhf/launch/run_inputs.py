"""What a run reads, before Ray starts (launch/run.py's run_locked calls read_files on its main thread): the LoRA
targets, the reward file's source, the checkpoint folder and the checkpoint to resume (its flags and each role's saved
layout), the tokenizer, the prompts with their images, and the eval prompts, each failing here with its flag named,
before Ray or anything else starts. Then, in a thread while Ray starts, finish_inputs imports what needs torch (the
reward file itself, the evaluator): torch's import is most of the driver's start-up, and Ray's start hides it.

Torch is not imported before Ray's start unless the run resumes (a DeepSpeed checkpoint's layout is read with it),
trains LoRA (its targets are checked on a model built on the meta device) or reads images.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orlhf.config.train_config import TrainConfig
from orlhf.launch.preflight import check_lora_targets

log = logging.getLogger("orlhf")


@dataclass
class RunInputs:
    """What a run reads before anything starts (read_files, then finish_inputs), kept across restarts
    (launch/restart.py)."""

    checkpoints: Any
    tokenizer: Any
    prompts: list
    eval_prompts: Optional[list]  # --eval_dataset's, None without it
    resume_from: Optional[Path]
    resume_step: Optional[int]
    run_id: str
    evaluator: Any = None  # finish_inputs: the Evaluator of eval_prompts
    reward: Any = None  # finish_inputs: make_reward's source, None when the reward-model group scores


def read_files(cfg: TrainConfig, run_id: str, run_logs) -> RunInputs:
    """Everything a run reads from files that can be wrong, before Ray starts (see the module docstring); the
    cheap checks first, the prompts (the longest read) last but the eval prompts."""
    run_logs.route_transformers()  # first: it imports transformers, before anything here can log through it
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.storage.checkpoint import CheckpointManager

    check_lora_targets(cfg)
    check_reward_file(cfg)
    lg = cfg.logging
    checkpoints = CheckpointManager(lg.checkpoint_dir, lg.max_ckpt_num, run_id, max_ckpt_mem=lg.max_ckpt_mem)
    resume_from, resume_step, run_id = resume_point(cfg, checkpoints, run_id)
    tokenizer = load_tokenizer(cfg.data.pretrain)
    prompts = load_prompts(cfg, tokenizer, load_vision_processor(cfg))
    new_loader(cfg, prompts)  # its problems (too few prompts for a batch) fail here, before any model starts
    eval_prompts = load_eval_prompts(cfg, tokenizer) if cfg.eval.eval_dataset is not None else None
    return RunInputs(checkpoints, tokenizer, prompts, eval_prompts, resume_from, resume_step, run_id)


def finish_inputs(cfg: TrainConfig, run: RunInputs) -> RunInputs:
    """`run` with its reward source and evaluator, in a thread while Ray starts (run_locked): what imports torch. A
    reward file whose import fails in a way its source does not show (check_reward_file) fails here."""
    import torch  # noqa: F401 - its import, beside Ray's start, is what this thread is for

    return dataclasses.replace(run, reward=make_reward(cfg), evaluator=make_evaluator(cfg, run.eval_prompts))


def check_reward_file(cfg: TrainConfig) -> None:
    """--remote_rm_url's .py file, from its source without running it (inputs/user_files.source_problem): a syntax
    error, a top-level import of a missing module or no reward_func is a DataError before Ray starts."""
    path = cfg.data.remote_rm_url
    if path is None or not path.endswith(".py") or not Path(path).expanduser().is_file():
        return  # a URL, or a missing file: make_reward_source says which
    from orlhf.inputs.errors import DataError
    from orlhf.inputs.user_files import source_problem

    problem = source_problem(str(Path(path).expanduser()), "reward_func")
    if problem is None:
        return
    if problem.endswith("defines no reward_func"):
        raise DataError(
            f"{problem}; define `def reward_func(queries, prompts, labels)` returning one float per query (a "
            "torch.Tensor of shape (B,)); see orlhf/demo/reward.py."
        )
    raise DataError(f"{problem}\nFix the file (`python {path}` shows the full error).")


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
    """--prompt_data (one source or a mix) -> formatted, tokenized Prompts, read as they are formatted (only the
    prompts kept stay in memory); logs the start-up line "prompts: N of M used (...)". `processor`:
    load_vision_processor's (loaded by builder_for when needed and not given)."""
    from orlhf.inputs.prompt_mix import read_prompts
    from orlhf.inputs.prompts import builder_for

    d, p = cfg.data, cfg.ppo
    builder = builder_for(tokenizer, d, p.prompt_max_len, processor)
    prompts, stats = read_prompts(d.prompt_data, d.prompt_data_probs, d.prompt_split, d.max_samples, p.seed, builder)
    log.info("%s", stats.summary())  # the summary starts with "prompts: " itself
    check_text_rows_fit(cfg, prompts)
    return prompts


def load_eval_prompts(cfg: TrainConfig, tokenizer) -> list:
    """--eval_dataset's rows (split --eval_split) formatted like the training prompts."""
    from orlhf.inputs.errors import DataError
    from orlhf.inputs.prompt_mix import read_prompts
    from orlhf.inputs.prompts import builder_for

    d, e = cfg.data, cfg.eval
    try:
        builder = builder_for(tokenizer, d, cfg.ppo.prompt_max_len)
        prompts, stats = read_prompts(e.eval_dataset, None, e.eval_split, None, cfg.ppo.seed, builder)
    except DataError as err:
        raise DataError(f"--eval_dataset: {err}") from err
    log.info("eval prompts: %s", stats.summary())
    return prompts


def check_text_rows_fit(cfg: TrainConfig, prompts: list) -> None:
    """Image prompts on ZeRO-3 groups of several ranks need an image in every prompt: ZeRO-3 gathers the vision
    tower's parameters on every rank together, so one rank running a micro-batch of text prompts (no vision forward)
    while another runs the tower would wait forever."""
    from orlhf.inputs.errors import DataError

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


def make_evaluator(cfg: TrainConfig, eval_prompts: Optional[list]):
    """--eval_dataset: the held-out prompts and when to run them (orlhf/trainer/evaluation.py); None without it."""
    if eval_prompts is None:
        return None
    from orlhf.trainer.evaluation import Evaluator

    e = cfg.eval
    return Evaluator(
        eval_prompts,
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
