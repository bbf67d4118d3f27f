"""Bringing a run's processes up on their placement groups, in start_plan's order, each shut down when the run's
ExitStack closes (entry.run_locked drives it and marks the start-up clock between phases):

    launch_engines   the vLLM engines' actors, not waited for (vLLM's import and LLM() are the longest chain)
    start_models     the model groups spawned concurrently (one thread each), guests hosted in their host's
                     processes (the reference inside the actor's on CPU), all init() together, then the engines
                     awaited and the weight-sync group built -> controller.Models
    start_plan       own devices: engines and trainers together; colocated on GPUs: the engines first, alone
                     (vLLM's memory profile sees only itself), asleep with --vllm_enable_sleep, then the trainers
Said once as it starts: the forwards left out because they cannot change an update (no reference without a KL,
no old-log-prob forward on a single pass), and the groups that left ZeRO-3 (one rank: nothing to partition).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

from orlhf.config.train_config import TrainConfig
from orlhf.config.worker_config import worker_config

log = logging.getLogger("orlhf")


def launch_engines(cfg: TrainConfig, placed, stack: ExitStack):
    """The engines' actors on their bundles, started without waiting for them (EngineGroup.wait_ready waits);
    shut down when `stack` closes."""
    from orlhf.rollout.engine import EngineGroup, engine_config

    engines = EngineGroup(
        engine_config(cfg),
        [placed.engine_bundles(i) for i in range(cfg.vllm.num_engines)],
        timeout_s=cfg.runtime.ray_timeout_s,
        wait=False,
    )
    stack.callback(engines.shutdown)
    return engines


def start_models(cfg: TrainConfig, placed, optimizer_steps: int, stack: ExitStack, clock=None, engines=None):
    """Engines and model groups on their bundles, started together; each is shut down when `stack` closes.

    `engines`: already launched (launch_engines), else launched here. Engines start first without waiting
    (vLLM's start-up is the longest); the model groups' actors are spawned
    and set up concurrently (one thread each: every ActorGroup waits on its ranks' process start and imports),
    then all groups init() together, then the engines are awaited. `clock` (startup.StartupClock) gets a mark
    after each of these phases."""
    from orlhf.config.roles import active_roles, guest_roles, runs_beside
    from orlhf.distributed.groups import ActorGroup
    from orlhf.rollout.engine import EngineActor
    from orlhf.trainer.controller import Models
    from orlhf.trainer.weight_sync import make_weight_sync
    from orlhf.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker
    from orlhf.workers.base import DeepSpeedWorker

    pl, timeout = cfg.placement, cfg.runtime.ray_timeout_s
    plan = start_plan(cfg)
    if engines is None:
        engines = launch_engines(cfg, placed, stack)
    if plan.index("wait_engines") < plan.index("start_models"):
        log.info(
            "vllm engines: %d, pids %s (started before the trainers share their GPUs)",
            len(engines),
            engines.wait_ready(),
        )
    if "sleep_engines" in plan:
        engines.call(EngineActor.sleep).get()
    workers = {"actor": PolicyWorker, "ref": ReferenceWorker, "critic": CriticWorker, "reward": RewardWorker}
    log_skipped_forwards(cfg)
    log_zero_stages(cfg)
    mark = clock.mark if clock is not None else (lambda phase: None)

    guests = guest_roles(cfg)  # the ref in the actor's processes on CPU

    def spawn(role: str) -> ActorGroup:
        return ActorGroup(
            role,
            workers[role],
            worker_config(cfg, role, optimizer_steps),
            placed.role_bundles(role),
            device=cfg.device,
            gpus_per_node=getattr(pl, f"{role}_num_gpus_per_node"),
            timeout_s=timeout,
            guests=[guest for guest, host in guests.items() if host == role],
        )

    # no ref without a KL (TrainConfig.has_reference)
    groups = _spawn_concurrently([role for role in active_roles(cfg) if role not in guests], spawn, stack)
    _host_guests(
        groups,
        guests,
        lambda role: (workers[role], worker_config(cfg, role, optimizer_steps)),
        stack,
        beside={role for role in guests if runs_beside(cfg, role)},
    )
    mark("groups spawned")
    for call in [g.call(DeepSpeedWorker.init) for g in groups.values()]:
        call.get()
    mark("groups init")
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
    )


def _spawn_concurrently(roles: list[str], spawn, stack: ExitStack) -> dict:
    """{role: spawn(role)} built in parallel threads; every group built is shut down when `stack` closes, also
    when another one failed (its error is raised after all have finished)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(roles), thread_name_prefix="orlhf-spawn") as pool:
        futures = {role: pool.submit(spawn, role) for role in roles}
    groups, errors = {}, []
    for role, future in futures.items():
        if future.exception() is not None:
            errors.append(future.exception())
            continue
        groups[role] = future.result()
        stack.callback(groups[role].shutdown)
    if errors:
        raise errors[0]
    return groups


def _host_guests(groups: dict, guests: dict, worker_of, stack: ExitStack, beside: frozenset = frozenset()) -> None:
    """Add each guest role (roles.host_of) to `groups` as a view onto its host's rank actors. After its host in
    `groups`, so its init() is numbered after the host's in every process (distributed/groups.py). `beside`: the guests
    whose
    work calls run beside the host's (roles.runs_beside)."""
    for role, host in guests.items():
        groups[role] = groups[host].host(role, *worker_of(role), beside=role in beside)
        stack.callback(groups[role].shutdown)  # lets go only: the host's shutdown kills the processes
        log.info(
            "%s: %d rank(s) inside the %s's rank processes%s, pids %s (CPU; --%s_own_process gives it "
            "processes of its own)",
            role,
            groups[role].world_size,
            host,
            ", its calls beside the " + host + "'s" if role in beside else "",
            groups[role].pids(),
            role,
        )


def log_skipped_forwards(cfg: TrainConfig) -> None:
    """Say which forwards this run leaves out because they cannot change an update."""
    if not cfg.has_reference:
        log.info(
            "no reference model: --init_kl_coef 0 without --use_kl_loss puts no KL anywhere%s",
            " (--colocate_actor_ref has nothing to colocate)" if cfg.placement.colocate_actor_ref else "",
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
            "ZeRO stage %s: one rank per group has nothing to partition, and ZeRO-3's hooks would cost "
            "1.25-1.6x per train step on CPU (--zero_stage 3 keeps ZeRO-3)",
            ", ".join(f"{role} {stage or 'none'}" for role, stage in off.items()),
        )


def start_plan(cfg: TrainConfig) -> tuple[str, ...]:
    """The order start_models brings things up.

    Own devices: engines and trainers start together (the engines load while DeepSpeed initialises).
    Colocated on GPUs: the engines first, alone on the GPUs, so vLLM's memory profile sees only itself; then,
    with --vllm_enable_sleep, they sleep (weights and KV cache freed) before the trainers allocate: OpenRLHF's
    order. The controller's SleepSwitch starts from that asleep state.
    """
    if cfg.placement.colocate_all_models and cfg.device == "cuda":
        return (
            ("start_engines", "wait_engines")
            + (("sleep_engines",) if cfg.vllm.enable_sleep else ())
            + ("start_models",)
        )
    return ("start_engines", "start_models", "wait_engines")
