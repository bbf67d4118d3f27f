"""Bringing a run's processes up on their placement groups, in the rollout backend's order (its Bringup's steps,
rollout/backend.py), each shut down when the run's ExitStack closes (launch/run.py's run_attempt drives it and marks
the start-up clock between phases):

    launch_rollout   Bringup.launch: what the backend starts before the model groups (the vLLM engines' actors,
                     not waited for: vLLM's import and LLM() are the longest chain)
    start_models     Bringup.before_models (on shared GPUs the engines first, alone, asleep with
                     --vllm_enable_sleep); the model groups spawned concurrently (one thread each), as the platform's
                     tuning builds them (tuning_for: on CPU the reference inside the actor's processes), all init()
                     together; then Bringup.connect (engines awaited, weight-sync group) -> controller.Models
    start_plan       the backend's steps, as words (for logs and tests)
Said once as it starts: the forwards left out because they cannot change an update (no reference without a KL,
no old-log-prob forward on a single pass), and the groups that left ZeRO-3 (one rank: nothing to partition).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Optional

from orlhf.config.train_config import TrainConfig
from orlhf.config.worker_config import worker_config
from orlhf.distributed.layout import Layout, plan_layout
from orlhf.distributed.tuning import Tuning

log = logging.getLogger("orlhf")


def tuning_for(cfg: TrainConfig) -> Tuning:
    """The platform's hooks (distributed/tuning.py): CPU runs' from orlhf/cpu/, imported for them only, so a GPU
    run never loads it; the plain path elsewhere."""
    if cfg.device == "cpu":
        from orlhf.cpu.tuning import CpuTuning

        return CpuTuning.for_config(cfg)
    return Tuning()


def run_layout(cfg: TrainConfig, tuning: Optional[Tuning] = None) -> Layout:
    """The run's layout (distributed/layout.py), with the platform's guests (Tuning.guests: on CPU the roles hosted
    in another role's processes, cpu/hosting_rules.py). `tuning`: tuning_for(cfg) unless given."""
    return plan_layout(cfg, (tuning or tuning_for(cfg)).guests(cfg))


def launch_rollout(cfg: TrainConfig, placed, stack: ExitStack, tuning: Optional[Tuning] = None):
    """What the run's rollout backend starts before the model groups (the vLLM engines' actors, not waited for), shut
    down when `stack` closes; None when nothing starts early (rollout/backend.py). `tuning`: tuning_for(cfg) unless
    given."""
    from orlhf.rollout.backend import backend_class

    return backend_class(cfg).bringup(cfg).launch(placed, stack, tuning or tuning_for(cfg))


def start_models(
    cfg: TrainConfig,
    placed,
    optimizer_steps: int,
    stack: ExitStack,
    clock=None,
    rollout=None,
    tuning: Optional[Tuning] = None,
    tokenizer=None,
):
    """The rollout backend and the model groups on their bundles, started together; each is shut down when `stack`
    closes.

    `rollout`: already launched (launch_rollout), else launched here. What the backend starts early begins first
    without waiting (vLLM's start-up is the longest); the model groups are built as `tuning` says
    (Tuning.model_groups; tuning_for unless given), then all groups init() together, then the backend connects (the
    engines awaited and the weight-sync group built; --rollout_backend trainer: the actor's ranks generate, with the
    `tokenizer`'s pad and EOS ids). `clock` (launch/startup_clock.StartupClock) gets a mark after each phase."""
    from orlhf.rollout.backend import backend_class
    from orlhf.trainer.models import Models
    from orlhf.workers.base import DeepSpeedWorker

    bringup = backend_class(cfg).bringup(cfg)
    tuning = tuning or tuning_for(cfg)
    if rollout is None:
        rollout = bringup.launch(placed, stack, tuning)
    bringup.before_models(rollout)
    log_skipped_forwards(cfg)
    log_zero_stages(cfg)
    mark = clock.mark if clock is not None else (lambda phase: None)
    groups = model_groups(cfg, placed, optimizer_steps, stack, tuning)
    mark("groups spawned")
    for call in [g.call(DeepSpeedWorker.init) for g in groups.values()]:
        call.get()
    mark("groups init")
    rollout = bringup.connect(rollout, groups["actor"], tokenizer, stack, mark)
    return Models(
        actor=groups["actor"],
        ref=groups.get("ref"),
        rollout=rollout,
        critic=groups.get("critic"),
        reward=groups.get("reward"),
        tuning=tuning,
    )


def model_groups(cfg: TrainConfig, placed, optimizer_steps: int, stack: ExitStack, tuning: Tuning) -> dict:
    """{role: group} of the run's models (no ref without a KL: TrainConfig.has_reference), as `tuning` builds them
    (Tuning.model_groups) with an ActorGroup per role on its bundles; each shut down when `stack` closes."""
    from orlhf.distributed.addresses import spec_env
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
            env=spec_env(cfg.runtime.socket_ifname),
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
            "ZeRO stage %s: one rank per group has nothing to partition, and ZeRO's hooks, copies and gradient "
            "all-reduce would only slow its steps (--zero_stage N keeps ZeRO-N)",
            ", ".join(f"{role} {stage or 'none'}" for role, stage in off.items()),
        )


def start_plan(cfg: TrainConfig) -> tuple[str, ...]:
    """The order start_models brings things up: the rollout backend's Bringup steps (rollout/backend.py)."""
    from orlhf.rollout.backend import backend_class

    return backend_class(cfg).bringup(cfg).steps
