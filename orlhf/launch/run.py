"""What `orlhf train-ppo` runs once its flags are a finished TrainConfig (config/resolve.py: validated, the device and
the demo's paths resolved).

    lock the run and checkpoint folders (runlock: a second run on them exits here) -> file pre-flight (weight files,
    value heads, agent file), the disk's free space (one line; refused where the final model or one checkpoint
    cannot fit) -> the tokenizer, prompts, reward file's source, eval data, checkpoint to resume
    (launch/run_inputs.py), their errors raised before Ray starts -> Ray connects (meanwhile, in a thread: the
    reward file imported, torch with it) -> pre-flight + placement groups -> the rollout backend's early start (vLLM
    engines, async) and model groups (colocated on GPUs: engines ready -> engines asleep -> model groups;
    launch/bringup.py) -> init all -> the backend connected (weight-sync group)
    -> Controller.fit()
    -> export the final actor, and critic (atomic; failed: a checkpoint keeps the weights, launch/export.py)
    -> draw the reward curve (best effort) -> tear everything down (also on errors and Ctrl-C), the local Ray
    cluster's processes waited for (ray_start.end_ray)
SIGINT / SIGTERM at any phase: one line says where, what is kept and how to continue (launch/stop_signals.py).
A process lost on the way (a rank or an engine whose process died) tears down the placement groups and everything on
them and starts them again from the run's newest checkpoint, up to --max_restarts times (launch/restart.py).
"""

from __future__ import annotations

import gc
import logging
import math
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Iterator

from orlhf.config.redact import public_config
from orlhf.config.train_config import TrainConfig
from orlhf.distributed.ray_start import connect_ray, end_ray
from orlhf.launch.bringup import launch_rollout, run_layout, start_models, tuning_for
from orlhf.launch.preflight import preflight
from orlhf.launch.run_inputs import finish_inputs, new_loader, read_files
from orlhf.launch.stop_signals import RESTART, RunStop
from orlhf.storage.disk_space import check_disk_space
from orlhf.storage.logs import TRACE
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
    with (
        hold_folders(cfg.logging.save_path, cfg.logging.checkpoint_dir, run_id),
        RunStop.for_run(cfg.runtime.stop_grace_s) as stop,
    ):
        try:
            code = run_locked(cfg, run_id, clock, stop)
        except BaseException:
            if not stop.at_once:  # a signal stopped it at once (what its teardown raised on the way is its echo)
                raise
            code = None
        return stop.outcome(code)  # a signal's stop: one line, where and what is kept (launch/stop_signals.py)


def run_locked(cfg: TrainConfig, run_id: str, clock, stop: RunStop) -> int:
    """train_ppo once this process holds the run folder and the checkpoint folder (`clock`:
    launch/startup_clock.StartupClock; `stop`: how SIGINT and SIGTERM end the run). Its phases, in order; each one's
    cleanup runs when the run leaves it (also on errors and signals), the last one entered first."""
    # Only what Ray's start needs is imported before it: torch (the reward file, the controller) loads in the inputs
    # thread while ray.init waits on Ray's processes.
    import ray  # noqa: F401

    run_logs = open_run_folder(cfg)
    tuning = tuning_for(cfg)  # the platform's hooks (distributed/tuning.py), for the layout, Ray, engines and groups
    layout = run_layout(cfg, tuning)
    with ExitStack() as stack:
        stack.enter_context(collector_paused())  # until the controller exists (run_attempt freezes, then resumes it)
        # What the run reads from files (the tokenizer, prompts and their images, the reward file's source, eval data,
        # the checkpoint to resume) fails here, before Ray starts; what imports torch follows beside Ray's start.
        run = read_files(cfg, run_id, run_logs)
        stop.checkpoints = run.checkpoints
        clock.mark("inputs")
        finishing = stack.enter_context(inputs_thread(cfg, run))
        stack.enter_context(ray_cluster(cfg, layout, tuning, stop))
        clock.mark("ray")
        run = finishing.result()  # the reward file imported: what its source did not show fails here
        clock.mark("torch")
        code = run_attempts(cfg, layout, tuning, run, stop, clock)
    run_logs.close()
    return code


def open_run_folder(cfg: TrainConfig):
    """The run folder's logs (once the folder is ours), its run_config.json, the file pre-flight and the disk's free
    space (one line each where something is wrong). Returns the driver's logs (storage/logs.py)."""
    from orlhf.storage.logs import setup_driver

    run_logs = setup_driver(cfg.logging.save_path, cfg.runtime.verbose)
    log.info("%s", run_logs.summary())
    write_resolved_config(cfg)
    preflight(cfg, run_logs)
    check_disk_space(cfg)  # what the run will write against the free space of its folders: one line
    return run_logs


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collections during start-up: the driver's imports (torch, the tokenizer, Ray's client) build
    objects that live as long as the run, and Python's collector would walk them again and again while every
    process of the run is starting on the same cores. Back on when leaving, also when start-up fails."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def inputs_thread(cfg: TrainConfig, run) -> Iterator[Future]:
    """finish_inputs (the reward file imported, torch with it) in a thread of its own while Ray starts; yields its
    future, and waits for it on leaving."""
    with ThreadPoolExecutor(1, thread_name_prefix="orlhf-inputs") as pool:
        yield pool.submit(finish_inputs, cfg, run)


@contextmanager
def ray_cluster(cfg: TrainConfig, layout, tuning, stop: RunStop) -> Iterator[None]:
    """Ray joined or started (distributed/ray_start.py) with the platform's `tuning`, in this thread: Ray sets its
    SIGTERM handler only here, so the run's handlers are taken back right after. On leaving, a cluster this process
    started is ended, also one whose start a signal cut short."""
    import ray

    from orlhf.distributed.layout import cpu_slots_needed, local_num_cpus

    joined_before = ray.is_initialized()
    try:
        connect_ray(cfg, local_num_cpus(layout), cpu_slots_needed(layout), tuning)
        stop.take_back()  # (ray.init was kept from replacing them: connect_ray)
        yield
    finally:
        end_ray(joined_before)


def run_attempts(cfg: TrainConfig, layout, tuning, run, stop: RunStop, clock) -> int:
    """The run's groups started and trained (run_attempt); with --max_restarts, a lost process starts them again
    from the newest checkpoint (launch/restart.py). Returns the exit code."""
    from orlhf.launch.restart import Attempt, RunRestarts

    restarts = RunRestarts(cfg.runtime.max_restarts, cfg.logging.save_path, run.run_id, run.resume_from is not None)
    attempt = Attempt(run.resume_from, run.resume_step, first_step=run.resume_step or 0)
    while True:
        stop.follow(attempt)
        with ExitStack() as held:  # the attempt's placement groups, engines and groups, torn down on leaving
            try:
                return run_attempt(cfg, layout, tuning, run, attempt, held, clock)
            except Exception as e:  # (its health check needs the processes still up; never after a stop signal)
                if stop.signal is not None or not restarts.may_restart(e, attempt):
                    raise
                stop.phase = RESTART
        attempt = restarts.next_attempt(attempt, run.checkpoints)


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
    if not gc.isenabled():  # the first attempt to get here (collector_paused holds it off for the start-up)
        gc.freeze()
        gc.enable()
    if clock is not None:
        log.info("%s", clock.report())
        clock.save(RunFolder.at(cfg.logging.save_path).startup)
    attempt.phase = "training"  # SIGINT / SIGTERM: the step ends and is saved, then the run stops (stop_signals.py)
    try:
        controller.fit()
    finally:
        metrics.close(plot=False)
    if controller.stop_signal is None:
        attempt.phase = "export"  # a signal lets the export finish
        logging.getLogger(TRACE).info("export")
        finish_run(cfg, models, metrics, attempt.history(), run.run_id, controller)
        attempt.complete = True
    attempt.phase = "done"
    return 0


def write_resolved_config(cfg: TrainConfig) -> None:
    """The run folder's run_config.json: every setting, its value and where it came from (config/provenance.py;
    `orlhf train-ppo ... --print_config` shows the same without running). Written at every start: a resume's own
    flags are this invocation's, while each checkpoint keeps the copy it was written under."""
    from orlhf.config.provenance import dump_resolved

    path = RunFolder.at(cfg.logging.save_path).config
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_resolved(cfg))


def remove_placement(placed) -> None:
    from orlhf.distributed.placement import remove_placement_groups

    remove_placement_groups(placed)


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


def finish_run(cfg: TrainConfig, models, metrics, history: list[dict], run_id: str, controller) -> None:
    """The run's outputs, models first (atomic export, then the critic), then the best-effort figures: a plotting
    failure costs a figure, never a model. A failed export keeps the weights in a checkpoint first, then stops with
    one line saying where (export.export_failed)."""
    from orlhf.launch.export import export_actor, export_failed, export_model
    from orlhf.trainer.run_state import missing_checkpoint
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
    stopping = controller.stop_signal is not None  # a signal came during the export: no figures (`orlhf report`)
    png = None if stopping else metrics.plot()
    log.info(
        "done: %d steps; final actor in %s; metrics in %s%s%s",
        len(history),
        out,
        metrics.path,
        f"; curve in {png}" if png else "",
        missing_checkpoint(controller),  # the last save refused by a full disk
    )
    summarize(history)
    if not stopping:
        write_report(cfg.logging.save_path)


def write_report(save_path: str) -> None:
    """`orlhf report` at the end of the run. Best effort: the model is already saved, so a plotting failure only
    costs the figure."""
    try:
        from orlhf.storage.report import write_report as write

        png, html = write(save_path)
        log.info("report: %s and %s", png, html)
    except Exception as e:  # noqa: BLE001 - never lose a finished run to a plot
        log.warning("could not write the report (%s: %s); `orlhf report %s` retries it", type(e).__name__, e, save_path)


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
