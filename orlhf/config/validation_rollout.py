"""How rollouts are generated: the rules of the rollout backend (config/rollout_backends.py: a backend that places
no engines, such as --rollout_backend trainer or --vllm_num_engines 0, leaves the engine flags nothing to act on, and
where the actor's ranks generate, generation cannot overlap their training), of --partial_rollout
(rollout/partial.py), and of --router_replay (whose experts the actor replays). Whether --pretrain is a
mixture-of-experts family it replays is read from its files (launch/preflight.py)."""

from __future__ import annotations

from orlhf.config.rollout_backends import BACKENDS, NO_ENGINES
from orlhf.config.train_config import TrainConfig

# Flags that configure the engines only: given with the trainer backend they would be silently ignored.
ENGINE_FLAGS = (
    "vllm_tensor_parallel_size",
    "vllm_sync_backend",
    "vllm_sync_with_ray",
    "vllm_sync_delta",
    "vllm_gpu_memory_utilization",
    "enable_prefix_caching",
    "enforce_eager",
    "vllm_enable_sleep",
    "vllm_cpu_kv_cache_gb",
    "vllm_cpu_threads",
    "vllm_sync_bucket_mb",
    "vllm_generate_batch_size",
    "max_engine_restarts",
)


def chosen_by(cfg: TrainConfig) -> str:
    """The flags that chose the run's backend, as an error names them: --vllm_num_engines 0 when that resolved it."""
    if cfg.rollout_name != cfg.vllm.rollout_backend:
        return "--vllm_num_engines 0"
    return cfg.rollout.how or f"--rollout_backend {cfg.rollout_name}"


def _generates(cfg: TrainConfig) -> str:
    return "generates in the actor's ranks" if cfg.rollout.in_actor else "places no engines"


def known(cfg: TrainConfig) -> list[str]:
    """A --rollout_backend of the table (the CLI's choices come from it; a config built in code may still miss)."""
    name = cfg.vllm.rollout_backend
    if name in BACKENDS:
        return []
    return [f"--rollout_backend {name}: not a rollout backend; use one of {', '.join(BACKENDS)}."]


def backend(cfg: TrainConfig, explicit: frozenset[str], out: list[str]) -> None:
    v, spec = cfg.vllm, cfg.rollout
    if not spec.places_engines and "vllm_num_engines" in explicit and v.num_engines > 0:
        out.append(
            f"--rollout_backend {cfg.rollout_name} {_generates(cfg)}, but --vllm_num_engines {v.num_engines} asks "
            "for vLLM engines: give one of them."
        )
    if BACKENDS[v.rollout_backend].places_engines and "rollout_backend" in explicit and v.num_engines == 0:
        out.append(
            f"--rollout_backend {v.rollout_backend} needs --vllm_num_engines >= 1 (0 means the actor's ranks "
            f"generate: --rollout_backend {NO_ENGINES})."
        )
    if spec.places_engines:
        return
    how = chosen_by(cfg)
    given = [f"--{f}" for f in ENGINE_FLAGS if f in explicit]
    if given:
        runs = "the actor's ranks generate (no engine runs)" if spec.in_actor else "no engine runs"
        out.append(
            f"{' '.join(given)}: set{'s' if len(given) == 1 else ''} up vLLM engines, and with {how} {runs}: "
            f"drop {'it' if len(given) == 1 else 'them'}, or use vLLM engines (--vllm_num_engines N)."
        )
    if cfg.ppo.async_train and spec.in_actor:
        out.append(
            f"--async_train overlaps generation with training on other devices, and with {how} the actor's ranks "
            "both generate and train, one after the other: drop --async_train, or use vLLM engines."
        )


def partial(cfg: TrainConfig, explicit: frozenset[str], out: list[str]) -> None:
    """--partial_rollout lets weight syncs in between the segments of a generation that runs beside training."""
    ppo = cfg.ppo
    tokens = ppo.partial_rollout_tokens
    if tokens is not None and tokens < 1:
        out.append(f"--partial_rollout_tokens must be >= 1 (got {tokens}).")
    if not ppo.partial_rollout:
        if "partial_rollout_tokens" in explicit:
            out.append("--partial_rollout_tokens does nothing without --partial_rollout: add it or drop the count.")
        return
    if cfg.rollout.in_actor:
        how = chosen_by(cfg)
        out.append(
            f"--partial_rollout lets weight syncs into the vLLM engines' generation, and with {how} the actor's ranks "
            "generate between their training steps (no engine, no sync to let in): drop --partial_rollout."
        )
    elif not ppo.async_train:
        out.append(
            "--partial_rollout requires --async_train (as OpenRLHF): only there does a weight sync wait for a "
            "generation in flight. Add --async_train or drop --partial_rollout."
        )
    if cfg.data.agent_func_path and "partial_rollout_tokens" in explicit:
        out.append(
            "--partial_rollout_tokens cuts single-turn generations into segments; with --agent_func_path a weight "
            "sync lands between two turns of the episodes and a turn is not cut: drop --partial_rollout_tokens."
        )


def router_replay(cfg: TrainConfig, out: list[str]) -> None:
    """--router_replay R3 needs engines that record the experts; R2 the old-log-prob forward it records in."""
    mode, v = cfg.ppo.router_replay, cfg.vllm
    if mode == "R3" and not cfg.rollout.records_routing:
        who = "actor's ranks sample with the trainer's own routing" if cfg.rollout.in_actor else "backend records none"
        out.append(
            f"--router_replay R3 replays the experts the vLLM engines routed the samples to, and with {chosen_by(cfg)} "
            f"the {who}: nothing to replay. Use --router_replay R2 (the actor's first forward's experts, replayed in "
            "training) or vLLM engines."
        )
    elif mode == "R3" and cfg.runtime.device == "cpu" and v.enable_prefix_caching:
        out.append(
            "--router_replay R3 with --enable_prefix_caching on CPU: orlhf records the experts of the tokens vLLM-CPU "
            "computes (orlhf/cpu/routing_capture.py), and a prefix-cache hit computes none: drop "
            "--enable_prefix_caching."
        )
    elif mode == "R3" and cfg.runtime.device == "cuda" and not v.enable_prefix_caching:
        out.append(
            "--router_replay R3 on GPUs: vLLM returns routed experts only with prefix caching on (it keeps them per "
            "KV-cache block): add --enable_prefix_caching."
        )
    if mode == "R2" and cfg.single_pass:
        out.append(
            "--router_replay R2 replays in training the experts of the actor's old-log-prob forward, which this run "
            "does not make (one epoch, one optimizer step per batch, no KL in the rewards: the training forward is "
            "the first and only one, so nothing could route otherwise). Drop it, or use R3 for the engines' experts."
        )
