"""Bringing a run's processes up on their placement groups, in start_plan's order, each shut down when the run's
ExitStack closes (entry.run_locked drives it and marks the start-up clock between phases):

    launch_engines   the vLLM engines' actors, not waited for (vLLM's import and LLM() are the longest chain)
    start_models     the model groups spawned concurrently (one thread each), as the platform's tuning builds
                     them (tuning_for: on CPU the reference inside the actor's processes), all init() together,
                     then the engines awaited and the weight-sync group built -> controller.Models
    start_plan       own devices: engines and trainers together; colocated on GPUs: the engines first, alone
                     (vLLM's memory profile sees only itself), asleep with --vllm_enable_sleep, then the trainers
Said once as it starts: the forwards left out because they cannot change an update (no reference without a KL,
no old-log-prob forward on a single pass), and the groups that left ZeRO-3 (one rank: nothing to partition).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Optional

from orlhf.config.train_config import TrainConfig
from orlhf.config.worker_config import worker_config
from orlhf.distributed.tuning import Tuning

log = logging.getLogger("orlhf")


def tuning_for(cfg: TrainConfig) -> Tuning:
    """The platform's hooks (distributed/tuning.py): CPU runs' from orlhf/cpu/, imported for them only, so a GPU
    run never loads it; the plain path elsewhere."""
    if cfg.device == "cpu":
        from orlhf.cpu.tuning import CpuTuning

        return CpuTuning.for_config(cfg)
    return Tuning()


def launch_engines(cfg: TrainConfig, placed, stack: ExitStack, tuning: Optional[Tuning] = None):
    """The engines' actors on their bundles, started without waiting for them (EngineGroup.wait_ready waits);
    shut down when `stack` closes. `tuning`: tuning_for(cfg) unless given."""
    from orlhf.rollout.engine_config import engine_config
    from orlhf.rollout.engine_group import EngineGroup

    engines = EngineGroup(
        engine_config(cfg),
        [placed.engine_bundles(i) for i in range(cfg.num_engines)],
        timeout_s=cfg.runtime.ray_timeout_s,
        wait=False,
        tuning=tuning or tuning_for(cfg),
        hang_s=cfg.runtime.hang_timeout_s,
    )
    stack.callback(engines.shutdown)
    return engines


def start_models(
    cfg: TrainConfig,
    placed,
    optimizer_steps: int,
    stack: ExitStack,
    clock=None,
    engines=None,
    tuning: Optional[Tuning] = None,
    tokenizer=None,
):
    """Engines and model groups on their bundles, started together; each is shut down when `stack` closes.

    --rollout_backend trainer: no engines; the actor's ranks generate (rollout/actor_rollout.py, which needs the
    `tokenizer`'s pad and EOS ids) and stand in for the engines and the weight sync.
    `engines`: already launched (launch_engines), else launched here. Engines start first without waiting
    (vLLM's start-up is the longest); the model groups are built as `tuning` says (Tuning.model_groups; tuning_for
    unless given), then all groups init() together, then the engines are awaited. `clock`
    (startup.StartupClock) gets a mark after each of these phases."""
    from orlhf.rollout.actor_rollout import ActorRollout
    from orlhf.rollout.engine import EngineActor
    from orlhf.rollout.weight_sync import make_weight_sync
    from orlhf.trainer.controller import Models
    from orlhf.workers.base import DeepSpeedWorker

    tuning = tuning or tuning_for(cfg)
    plan = start_plan(cfg)
    if "start_engines" in plan and engines is None:
        engines = launch_engines(cfg, placed, stack, tuning)
    if "wait_engines" in plan and plan.index("wait_engines") < plan.index("start_models"):
        log.info(
            "vllm engines: %d, pids %s (started before the trainers share their GPUs)",
            len(engines),
            engines.wait_ready(),
        )
    if "sleep_engines" in plan:
        engines.call(EngineActor.sleep).get()
    if cfg.rollout_in_trainer:
        if tokenizer is None:
            raise ValueError("--rollout_backend trainer: start_models needs the run's tokenizer (pad and EOS ids)")
        log.info(
            "rollouts: generated in the actor's ranks with transformers' generate (--rollout_backend trainer): no "
            "vLLM engine, no weight sync; the sync guard compares the sampler's log-probs with the training forward's"
        )
    log_skipped_forwards(cfg)
    log_zero_stages(cfg)
    mark = clock.mark if clock is not None else (lambda phase: None)
    groups = model_groups(cfg, placed, optimizer_steps, stack, tuning)
    mark("groups spawned")
    for call in [g.call(DeepSpeedWorker.init) for g in groups.values()]:
        call.get()
    mark("groups init")
    if cfg.rollout_in_trainer:  # the actor's ranks stand in for the engines and their weight sync
        engines = sync = ActorRollout(groups["actor"], tokenizer.pad_token_id, tokenizer.eos_token_id)
        stack.callback(engines.shutdown)
    else:
        if plan.index("wait_engines") > plan.index("start_models"):
            log.info("vllm engines: %d, pids %s", len(engines), engines.wait_ready())
        mark("engines ready")
        sync = make_weight_sync(cfg, groups["actor"], engines)
        mark("weight sync group")
    return Models(
        actor=groups["actor"],
        ref=groups.get("ref"),
        engines=engines,
        sync=sync,
        critic=groups.get("critic"),
        reward=groups.get("reward"),
        tuning=tuning,
    )


def model_groups(cfg: TrainConfig, placed, optimizer_steps: int, stack: ExitStack, tuning: Tuning) -> dict:
    """{role: group} of the run's models (no ref without a KL: TrainConfig.has_reference), as `tuning` builds them
    (Tuning.model_groups) with an ActorGroup per role on its bundles; each shut down when `stack` closes."""
    from orlhf.distributed.groups import ActorGroup
    from orlhf.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker

    workers = {"actor": PolicyWorker, "ref": ReferenceWorker, "critic": CriticWorker, "reward": RewardWorker}

    def worker_of(role: str) -> tuple:
        return workers[role], worker_config(cfg, role, optimizer_steps)

    def spawn(role: str, **options) -> ActorGroup:
        return ActorGroup(
            role,
            *worker_of(role),
            placed.role_bundles(role),
            device=cfg.device,
            gpus_per_node=getattr(cfg.placement, f"{role}_num_gpus_per_node"),
            timeout_s=cfg.runtime.ray_timeout_s,
            hang_s=cfg.runtime.hang_timeout_s,
            **options,
        )

    return tuning.model_groups(cfg, spawn, worker_of, stack)


def log_skipped_forwards(cfg: TrainConfig) -> None:
    """Say which forwards this run leaves out because they cannot change an update."""
    if not cfg.has_reference:
        log.info(
            "no reference model: --init_kl_coef 0 without --use_kl_loss puts no KL anywhere%s",
            " (--colocate_actor_ref has nothing to colocate)" if cfg.placement.colocate_actor_ref else "",
        )
    if cfg.placement.colocate_all_models and cfg.ppo.async_train:
        log.warning(
            "--async_train with --colocate_all_models: the DeepSpeed models share the actor's devices, and the vLLM "
            "engines keep devices of their own, so generation overlaps training (as OpenRLHF's async mode does)"
        )
    for role in ("actor", "critic"):
        o = cfg.optim.of(role, cfg.ppo)
        if o["optim"] == "muon" and o["max_norm"] > 0 and (role == "actor" or cfg.has_critic):
            log.warning(
                "--%s_optim muon with gradient clipping at %g: DeepSpeed clips after Newton-Schulz, against the "
                "orthogonalized update's norm, which shrinks Muon's step; --%s_max_norm 0 turns clipping off (as "
                "OpenRLHF advises)",
                role,
                o["max_norm"],
                role,
            )
    if cfg.single_pass:
        log.info(
            "no old-log-prob forward: one optimizer step per batch (--max_epochs 1), so the PPO ratio is 1 and "
            "the actor's training forward supplies log pi_old"
        )


def log_zero_stages(cfg: TrainConfig) -> None:
    """Say which groups left ZeRO-3 by default (one rank: nothing to partition; worker_config.zero_stage_of)."""
    from orlhf.config.roles import active_roles
    from orlhf.config.worker_config import zero_stage_for

    if cfg.deepspeed.zero_stage is not None:
        return
    off = {role: zero_stage_for(cfg, role) for role in active_roles(cfg)}
    off = {role: stage for role, stage in off.items() if stage != 3}
    if off:
        log.info(
            "ZeRO stage %s: one rank per group has nothing to partition, and ZeRO-3's per-module hooks would "
            "only slow its train steps (--zero_stage 3 keeps ZeRO-3)",
            ", ".join(f"{role} {stage or 'none'}" for role, stage in off.items()),
        )


def start_plan(cfg: TrainConfig) -> tuple[str, ...]:
    """The order start_models brings things up.

    Own devices: engines and trainers start together (the engines load while DeepSpeed initialises).
    Colocated on GPUs: the engines first, alone on the GPUs, so vLLM's memory profile sees only itself; then,
    with --vllm_enable_sleep, they sleep (weights and KV cache freed) before the trainers allocate: OpenRLHF's
    order. The controller's SleepSwitch starts from that asleep state.
    --rollout_backend trainer: the model groups only.
    """
    if cfg.rollout_in_trainer:
        return ("start_models",)
    if cfg.engines_colocated and cfg.device == "cuda":
        return (
            ("start_engines", "wait_engines")
            + (("sleep_engines",) if cfg.vllm.enable_sleep else ())
            + ("start_models",)
        )
    return ("start_engines", "start_models", "wait_engines")
