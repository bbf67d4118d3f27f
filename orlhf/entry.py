"""What `orlhf train-ppo` runs once its flags are a valid TrainConfig.

    resolve demo paths and the device -> connect Ray -> pre-flight + placement groups -> prompts
    -> start engines (async) and model groups -> init all -> weight-sync group -> Controller.fit()
    -> save the final actor -> tear everything down (also on errors and Ctrl-C)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from contextlib import ExitStack
from pathlib import Path

from orlhf.config import TrainConfig, worker_config

log = logging.getLogger("orlhf")


def resolve_demo(cfg: TrainConfig) -> TrainConfig:
    """Without --pretrain: the built-in demo's model, prompts and reward function (built once, cached).

    Only unset paths are filled; a user's --prompt_data or --remote_rm_url / --reward_pretrain stays as given.
    """
    if not cfg.data.uses_demo:
        return cfg
    from orlhf.demo import ensure_demo

    demo = ensure_demo()
    d = cfg.data
    no_reward = d.remote_rm_url is None and d.reward_pretrain is None
    data = dataclasses.replace(d, pretrain=str(demo.model), prompt_data=d.prompt_data or str(demo.prompts),
                               remote_rm_url=str(demo.reward_fn) if no_reward else d.remote_rm_url)
    return dataclasses.replace(cfg, data=data)


def resolve_device(cfg: TrainConfig) -> TrainConfig:
    """--device auto -> cuda when torch sees a GPU, else cpu; the cuda/cpu rules are then checked again."""
    device = cfg.runtime.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = cfg.vllm.sync_backend or ("nccl" if device == "cuda" else "gloo")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=device),
                              vllm=dataclasses.replace(cfg.vllm, sync_backend=backend))
    from orlhf.validation import validate

    validate(cfg)
    return cfg


def connect_ray(cfg: TrainConfig, num_cpus: int) -> bool:
    """Join the given / the job's cluster, else start a local one. Returns True when this process started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS")
    # Workers' output goes to <save_path>/logs unless --verbose (logs.py); Ray's own driver-side records then go
    # to driver.log through the root logger instead of Ray's terminal handler.
    quiet = dict(log_to_driver=cfg.runtime.verbose, configure_logging=cfg.runtime.verbose)
    if address:
        ray.init(address=address, **quiet)
        return False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
    return True


def train_ppo(cfg: TrainConfig) -> int:
    """Run PPO with `cfg`. Returns the process exit code."""
    import ray

    from orlhf.checkpoint import CheckpointManager
    from orlhf.controller import Controller
    from orlhf.data import PromptLoader, build_prompts, load_prompt_rows, load_tokenizer
    from orlhf.metrics import MetricsLogger
    from orlhf.placement import create_placement_groups, local_num_cpus, plan_layout, remove_placement_groups

    from orlhf.logs import setup_driver

    run_logs = setup_driver(cfg.logging.save_path, cfg.runtime.verbose)
    cfg = resolve_device(resolve_demo(cfg))
    log.info("%s", run_logs.summary())
    device, d, p = cfg.runtime.device, cfg.data, cfg.ppo
    if cfg.deepspeed.packing_samples and not cfg.deepspeed.flash_attn:
        log.warning("--packing_samples without --flash_attn: attention runs over each packed row with a "
                    "block-diagonal mask, whose cost grows with the square of the row (on CPU: 0.55-0.7x of "
                    "the default trimmed micro-batches, benchmarks/bench_padding.py); packing pays with "
                    "flash-attn's varlen kernels on GPUs")
    tokenizer = load_tokenizer(d.pretrain)
    rows = load_prompt_rows(d.prompt_data, d.input_key, d.label_key, d.max_samples)
    prompts, stats = build_prompts(rows, tokenizer, d.input_key, d.label_key, d.apply_chat_template,
                                   d.input_template, p.prompt_max_len, d.prompt_overflow)
    log.info("prompts: %s", stats.summary())
    loader = PromptLoader(prompts, p.rollout_batch_size, p.num_episodes, p.seed)
    samples_per_step = p.rollout_batch_size * p.n_samples_per_prompt
    optimizer_steps = loader.total_steps * p.max_epochs * (samples_per_step // p.train_batch_size)
    layout = plan_layout(cfg, device)
    checkpoints = CheckpointManager(cfg.logging.ckpt_path, cfg.logging.max_ckpt_num)
    resume_from = find_checkpoint(cfg, checkpoints)  # one from other flags fails here, before anything starts

    with ExitStack() as stack:
        if connect_ray(cfg, local_num_cpus(layout)):
            stack.callback(ray.shutdown)
        placed = create_placement_groups(layout, cfg.runtime.ray_timeout_s)
        stack.callback(remove_placement_groups, placed)
        t0 = time.monotonic()
        models = start_models(cfg, placed, optimizer_steps, stack)
        log.info("%d model group(s) and %d engine(s) ready in %.1f s", len(models.groups()), len(models.engines),
                 time.monotonic() - t0)
        metrics = MetricsLogger(cfg.logging.save_path, use_wandb=cfg.logging.use_wandb,
                                wandb_project=cfg.logging.wandb_project, wandb_run_name=cfg.logging.wandb_run_name,
                                use_tensorboard=cfg.logging.use_tensorboard, config=dataclasses.asdict(cfg),
                                resume=resume_from is not None, wandb_org=cfg.logging.wandb_org,
                                wandb_group=cfg.logging.wandb_group)
        controller = Controller(cfg, models, loader, tokenizer, metrics, reward_source=make_reward(cfg),
                                checkpoints=checkpoints)
        if resume_from is not None:
            controller.resume(resume_from)
        try:
            history = controller.fit()
        finally:
            png = metrics.close()
        out = Path(cfg.logging.save_path) / "actor"
        models.actor.call_all("save_hf", str(out))
        if cfg.logging.save_value_network and models.critic is not None:
            models.critic.call_all("save_value_network", str(Path(cfg.logging.save_path) / "critic"))
        log.info("done: %d steps; final actor in %s; metrics in %s%s", len(history), out, metrics.path,
                 f"; curve in {png}" if png else "")
        summarize(history)
        write_report(cfg.logging.save_path)
    run_logs.close()
    return 0


def write_report(save_path: str) -> None:
    """`orlhf report` at the end of the run. Best effort: the model is already saved, so a plotting failure only
    costs the figure."""
    try:
        from orlhf.report import write_report as write

        png, html = write(save_path)
        log.info("report: %s and %s", png, html)
    except Exception as e:  # noqa: BLE001 - never lose a finished run to a plot
        log.warning("could not write the report (%s: %s); `orlhf report %s` retries it", type(e).__name__, e,
                    save_path)


def find_checkpoint(cfg: TrainConfig, checkpoints):
    """--load_checkpoint: the newest complete checkpoint (checked against these flags), or None to start fresh.
    Without it, a --ckpt_path that already holds checkpoints is refused when this run would save there."""
    from orlhf.checkpoint import check_compatible, config_fingerprint, read_meta

    checkpoints.cleanup_stale_tmp()
    if not cfg.logging.load_checkpoint:
        if cfg.logging.save_steps > 0:
            checkpoints.check_new_run()
        return None
    path = checkpoints.latest()
    if path is None:
        log.info("--load_checkpoint: no complete checkpoint in %s, starting fresh", cfg.logging.ckpt_path)
        return None
    check_compatible(read_meta(path), config_fingerprint(cfg), path)
    return path


def start_models(cfg: TrainConfig, placed, optimizer_steps: int, stack: ExitStack):
    """Engines and model groups on their bundles, started together; each is shut down when `stack` closes."""
    from orlhf.cluster import ActorGroup
    from orlhf.controller import Models
    from orlhf.rollout.engine import EngineGroup, engine_config
    from orlhf.weight_sync import make_weight_sync
    from orlhf.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker

    device, pl, timeout = cfg.runtime.device, cfg.placement, cfg.runtime.ray_timeout_s
    engines = EngineGroup(engine_config(cfg, device), [placed.engine_bundles(i) for i in range(cfg.vllm.num_engines)],
                          timeout_s=timeout, wait=False)
    stack.callback(engines.shutdown)
    workers = {"actor": PolicyWorker, "ref": ReferenceWorker, "critic": CriticWorker, "reward": RewardWorker}
    present = ["actor", "ref"] + (["critic"] if cfg.has_critic else []) + (["reward"] if cfg.has_reward_model else [])
    groups = {}
    for role in present:
        groups[role] = ActorGroup(role, workers[role], worker_config(cfg, role, device, optimizer_steps),
                                  placed.role_bundles(role), device=device,
                                  gpus_per_node=getattr(pl, f"{role}_num_gpus_per_node"), timeout_s=timeout)
        stack.callback(groups[role].shutdown)
    for call in [g.call_all_async("init") for g in groups.values()]:
        call.get()
    log.info("vllm engines: %d, pids %s", len(engines), engines.wait_ready())
    sync = make_weight_sync(cfg, groups["actor"], engines)
    return Models(actor=groups["actor"], ref=groups["ref"], engines=engines, sync=sync,
                  critic=groups.get("critic"), reward=groups.get("reward"))


def make_reward(cfg: TrainConfig):
    if cfg.data.remote_rm_url is None:
        return None  # the reward-model group scores
    from orlhf.rewards import make_reward_source

    return make_reward_source(cfg.data.remote_rm_url)


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
    log.info("reward: first %d steps %.3f -> last %d steps %.3f (x%.2f); %.1f samples/s; time: %s",
             k, first, k, last, last / first if first else math.inf, sps, share)
