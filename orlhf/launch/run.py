"""What `orlhf train-ppo` runs once its flags are a finished TrainConfig (config/resolve.py: validated, the device and
the demo's paths resolved).

    lock the run and checkpoint folders (runlock: a second run on them exits here) -> file pre-flight (weight files,
    value heads, agent file) -> prompts, reward file, eval data (in a thread) while Ray connects, their errors raised
    before anything is placed -> pre-flight + placement groups -> start engines (async) and model groups
    (colocated on GPUs: engines ready -> engines asleep -> model groups; launch/bringup.py) -> init all -> weight-sync
    group -> Controller.fit() (SIGINT / SIGTERM: the step ends and is saved, no export: launch/stop_signals.py)
    -> export the final actor, and critic (atomic; failed: a checkpoint keeps the weights, launch/export.py)
    -> draw the reward curve (best effort) -> tear everything down (also on errors and Ctrl-C)
A process lost on the way (a rank or an engine whose process died) tears down the placement groups and everything on
them and starts them again from the run's newest checkpoint, up to --max_restarts times (launch/restart.py).
"""

from __future__ import annotations

import gc
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orlhf.config.redact import public_config
from orlhf.config.train_config import TrainConfig
from orlhf.distributed.ray_start import connect_ray
from orlhf.launch.bringup import launch_rollout, start_models, tuning_for
from orlhf.launch.preflight import check_lora_targets, check_moe_for_aux_loss, preflight  # noqa: F401 - preflight and check_moe_for_aux_loss: tests import them here
from orlhf.launch.stop_signals import report_stop, stop_on_signals
from orlhf.storage.run_folder import RunFolder

log = logging.getLogger("orlhf")


def train_ppo(cfg: TrainConfig) -> int:
    """Run PPO with a finished `cfg` (resolve.finish_config). Returns the process exit code."""
    from orlhf.launch.startup_clock import StartupClock
    from orlhf.storage.runlock import hold_folders

    clock = StartupClock()  # from process start: imports and flag parsing count too
    logging.basicConfig(level=logging.INFO, format="[orlhf] %(message)s")
    clock.mark("imports")
    run_id = uuid.uuid4().hex[:12]  # a resumed run takes its checkpoint's (run_locked)
    with hold_folders(cfg.logging.save_path, cfg.logging.checkpoint_dir, run_id):
        return run_locked(cfg, run_id, clock)


def run_locked(cfg: TrainConfig, run_id: str, clock) -> int:
    """train_ppo once this process holds the run folder and the checkpoint folder (`clock`: startup.StartupClock)."""
    # Only what Ray's start needs is imported before it: torch (checkpoint, controller) loads in the inputs thread
    # (the tokenizer's transformers imports it) while ray.init waits on Ray's processes.
    import ray

    from orlhf.distributed.layout import cpu_slots_needed, local_num_cpus, plan_layout
    from orlhf.storage.logs import setup_driver

    run_logs = setup_driver(cfg.logging.save_path, cfg.runtime.verbose)  # once the run folder is ours
    log.info("%s", run_logs.summary())
    preflight(cfg, run_logs)
    layout = plan_layout(cfg)

    # No automatic collections during start-up: the driver's imports (torch, the tokenizer, Ray's client) build
    # objects that live as long as the run, and Python's collector would walk them again and again while every
    # process of the run is starting on the same cores. Frozen once the controller exists.
    gc.disable()
    with ExitStack() as stack:
        stack.callback(gc.enable)  # also when start-up fails
        inputs = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="orlhf-inputs"))
        reading = inputs.submit(read_inputs, cfg, run_id, run_logs)
        # in this thread: Ray sets its SIGTERM handler only here
        tuning = tuning_for(cfg)  # the platform's hooks (distributed/tuning.py), for Ray, engines and groups
        if connect_ray(cfg, local_num_cpus(layout), cpu_slots_needed(layout), tuning):
            stack.callback(ray.shutdown)
        clock.mark("ray")
        # What the run reads (prompts, the reward file, eval data, the checkpoint to resume) fails here, before any
        # placement group, engine or model starts: its thread has mostly finished while Ray started.
        run = reading.result()
        clock.mark("prompts")
        from orlhf.launch.restart import Attempt, RunRestarts

        restarts = RunRestarts(cfg.runtime.max_restarts, cfg.logging.save_path, run.run_id, run.resume_from is not None)
        attempt = Attempt(run.resume_from, run.resume_step, first_step=run.resume_step or 0)
        while True:  # --max_restarts: a lost process starts the groups again from the newest checkpoint (restart.py)
            with ExitStack() as held:  # the attempt's placement groups, engines and groups, torn down on leaving
                try:
                    code = run_attempt(cfg, layout, tuning, run, attempt, held, clock)
                    break
                except Exception as e:
                    if not restarts.may_restart(e, attempt):  # (its health check needs the processes still up)
                        raise
            attempt = restarts.next_attempt(attempt, run.checkpoints)
    run_logs.close()
    return code


def run_attempt(cfg: TrainConfig, layout, tuning, run, attempt, held: ExitStack, clock) -> int:
    """One start of the run's groups (restart.Attempt: the first, or one after a lost process): placement groups,
    engines and model groups (each torn down when `held` closes), the controller resumed at the attempt's checkpoint,
    fit, and the outputs. Returns the exit code."""
    from orlhf.distributed.placement import create_placement_groups

    first = attempt.number == 0
    clock = clock if first else None  # the start-up clock times the first start only
    mark = clock.mark if clock is not None else (lambda phase: None)
    wait = {} if first else {"settle_s": cfg.runtime.ray_timeout_s, "wait_for_nodes": True}  # a lost node's
    placed = create_placement_groups(layout, cfg.runtime.ray_timeout_s, **wait)
    held.callback(remove_placement, placed)
    t0 = time.monotonic()
    # The engines' start is the longest (vLLM's import, then LLM()): it begins before the model groups'.
    rollout = attempt.rollout = launch_rollout(cfg, placed, held, tuning)
    mark("placement")
    loader = new_loader(cfg, run.prompts)
    steps = optimizer_steps(cfg, loader)
    models = attempt.models = start_models(cfg, placed, steps, held, clock, rollout, tuning, run.tokenizer)
    log.info(
        "%d model group(s) and %d engine(s) ready in %.1f s",
        len(models.groups()),
        cfg.num_engines,
        time.monotonic() - t0,
    )
    if run.evaluator is not None:
        run.evaluator.best = None  # the checkpoint's, when resuming (run_state.restore_run)
    metrics = make_metrics(cfg, attempt.resume_step, run.run_id)
    controller = attempt.controller = make_controller(
        cfg, models, loader, run.tokenizer, metrics, run.checkpoints, run.evaluator, attempt.resume_from, run.reward
    )
    controller.run_restarts = attempt.number
    controller.first_step = attempt.first_step  # --stop_after_steps counts from the invocation's first step
    mark("controller")
    if not gc.isenabled():  # the first attempt to get here (run_locked disabled it for the start-up)
        gc.freeze()
        gc.enable()
    if clock is not None:
        log.info("%s", clock.report())
        clock.save(RunFolder.at(cfg.logging.save_path).startup)
    try:
        with stop_on_signals(controller):  # SIGINT / SIGTERM: stop at the step's end, saved (stop_signals.py)
            controller.fit()
    finally:
        metrics.close(plot=False)
    if controller.stop_signal is not None:
        return report_stop(controller)
    finish_run(cfg, models, metrics, attempt.history(), run.run_id, controller)
    return 0


def remove_placement(placed) -> None:
    from orlhf.distributed.placement import remove_placement_groups

    remove_placement_groups(placed)


def new_loader(cfg: TrainConfig, prompts: list):
    """The prompt loader of an attempt, at the run's start (a resume sets its position: run_state.restore_run)."""
    from orlhf.inputs.prompt_loader import PromptLoader

    p = cfg.ppo
    return PromptLoader(prompts, p.rollout_batch_size, p.num_episodes, p.seed)


def optimizer_steps(cfg: TrainConfig, loader) -> int:
    """Optimizer steps of the whole run (the LR schedule's length): each step's samples in train batches, per epoch."""
    p = cfg.ppo
    samples_per_step = p.rollout_batch_size * p.n_samples_per_prompt
    return loader.total_steps * p.max_epochs * (samples_per_step // p.train_batch_size)


def make_controller(cfg: TrainConfig, models, loader, tokenizer, metrics, checkpoints, evaluator, resume_from, reward):
    """The Controller of this run (after resume_point: the run's id), resumed from `resume_from` when given.
    `reward`: make_reward's source, None when the reward-model group scores."""
    from orlhf.trainer.controller import Controller

    controller = Controller(
        cfg,
        models,
        loader,
        tokenizer,
        metrics,
        reward_source=reward,
        checkpoints=checkpoints,
        evaluator=evaluator,
        best_checkpoints=checkpoints.best(),
    )
    if resume_from is not None:
        controller.resume(resume_from)
    return controller


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


def make_metrics(cfg: TrainConfig, resume_step, run_id: str):
    """The run's metrics.jsonl (and W&B / TensorBoard when asked), continuing after `resume_step` when resuming."""
    from orlhf.storage.metrics import MetricsLogger

    lg = cfg.logging
    return MetricsLogger(
        lg.save_path,
        use_wandb=lg.use_wandb,
        wandb_project=lg.wandb_project,
        wandb_run_name=lg.wandb_run_name,
        use_tensorboard=lg.use_tensorboard,
        config=public_config(cfg),
        resume_step=resume_step,
        run_id=run_id,
        wandb_org=lg.wandb_org,
        wandb_group=lg.wandb_group,
    )


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


def finish_run(cfg: TrainConfig, models, metrics, history: list[dict], run_id: str, controller) -> None:
    """The run's outputs, models first (atomic export, then the critic), then the best-effort figures: a plotting
    failure costs a figure, never a model. A failed export keeps the weights in a checkpoint first, then stops with
    one line saying where (export.export_failed)."""
    from orlhf.launch.export import export_actor, export_failed, export_model
    from orlhf.workers import CriticWorker, PolicyWorker

    folder = RunFolder.at(cfg.logging.save_path)
    target = folder.actor
    try:
        out = export_actor(models.actor, target, run_id)  # with LoRA: the adapter, PEFT's format
        if cfg.lora.lora_save_merged:
            target = folder.actor_merged
            merged = export_model(models.actor, PolicyWorker.save_hf_merged, target, run_id)
            log.info("the actor with its adapter merged in: %s (a plain HF folder)", merged)
        if cfg.logging.save_value_network and models.critic is not None:
            target = folder.critic
            export_model(models.critic, CriticWorker.save_value_network, target, run_id)
    except Exception as e:
        raise export_failed(e, target, controller) from None
    png = metrics.plot()
    log.info(
        "done: %d steps; final actor in %s; metrics in %s%s",
        len(history),
        out,
        metrics.path,
        f"; curve in {png}" if png else "",
    )
    summarize(history)
    write_report(cfg.logging.save_path)


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


def write_report(save_path: str) -> None:
    """`orlhf report` at the end of the run. Best effort: the model is already saved, so a plotting failure only
    costs the figure."""
    try:
        from orlhf.storage.report import write_report as write

        png, html = write(save_path)
        log.info("report: %s and %s", png, html)
    except Exception as e:  # noqa: BLE001 - never lose a finished run to a plot
        log.warning("could not write the report (%s: %s); `orlhf report %s` retries it", type(e).__name__, e, save_path)


def find_checkpoint(cfg: TrainConfig, checkpoints):
    """--load_checkpoint: the newest complete checkpoint (checked against these flags), or None to start fresh (there
    is none yet: said in one line). Without it, a --ckpt_path that already holds checkpoints is refused when this
    run would save there."""
    from orlhf.config.fingerprint import config_fingerprint
    from orlhf.storage.checkpoint import read_meta
    from orlhf.storage.checkpoint_format import check_compatible

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
    check_compatible(read_meta(path), config_fingerprint(cfg), path)
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


def summarize(history: list[dict]) -> None:
    """The numbers a user wants at the end: reward first vs last steps, speed, where the time went."""
    if not history:
        return
    k = max(1, min(10, len(history) // 2))
    first = sum(r["reward_mean"] for r in history[:k]) / k
    last = sum(r["reward_mean"] for r in history[-k:]) / k
    sps = sum(r["samples"] for r in history) / sum(r["step_s"] for r in history)
    phases = {key[7:]: sum(r[key] for r in history) for key in history[0] if key.startswith("timing/")}
    total = sum(phases.values()) or 1.0
    share = ", ".join(f"{name} {100 * v / total:.0f}%" for name, v in phases.items())
    log.info(
        "reward: first %d steps %.3f -> last %d steps %.3f (x%.2f); %.1f samples/s; time: %s",
        k,
        first,
        k,
        last,
        last / first if first else math.inf,
        sps,
        share,
    )
