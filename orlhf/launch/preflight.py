"""The checks train-ppo makes from files before Ray starts or any rank loads a model (launch/run.py calls them), so a
wrong folder, head, agent file or LoRA target fails in a second with one line naming the flag and the file."""

from __future__ import annotations

import logging
from pathlib import Path

from orlhf.config.roles import model_path
from orlhf.config.train_config import TrainConfig
from orlhf.launch.bringup import tuning_for

log = logging.getLogger("orlhf")


def preflight(cfg: TrainConfig, run_logs=None) -> None:
    """Checks that read files before Ray starts, so a truncated weight file, a wrong agent file or value head fails in
    a second.
    `run_logs` (logs.RunLogs) routes transformers' logging first when they may import it."""
    check_vision_model(cfg)  # config.json only
    check_weight_files(cfg)  # every model folder's safetensors headers and sizes: milliseconds
    check_value_heads(cfg)  # config.json and tensor headers only: milliseconds (head_files.check_head)
    check_moe_for_aux_loss(cfg, run_logs)
    check_replayed_family(cfg)  # config.json only
    tuning_for(cfg).preflight(cfg)  # the platform's own (CPU: --bf16 without bf16 instructions, cpu/bf16.py)
    if cfg.deepspeed.packing_samples and not cfg.deepspeed.flash_attn:
        log.warning(
            "--packing_samples without --flash_attn: attention runs over each packed row with a "
            "block-diagonal mask, whose cost grows with the square of the row (benchmarks/probes/bench_padding.py "
            "compares it with the default trimmed micro-batches); packing pays with flash-attn's varlen kernels "
            "on GPUs"
        )
    if run_logs is not None and cfg.data.agent_func_path:
        run_logs.route_transformers()  # an agent file may import transformers here
    if cfg.data.agent_func_path:  # an agent file that does not import or defines no AgentExecutor
        from orlhf.rollout.executor import load_agent_executor

        load_agent_executor(cfg.data.agent_func_path)


def check_vision_model(cfg: TrainConfig) -> None:
    """--max_images_per_prompt > 0 needs a vision-language --pretrain: its config.json has a vision_config (how
    OpenRLHF tells one); a ConfigError (exit 2) naming the folder otherwise, where the processor or the first forward
    would fail after the start-up. A hub id not in the local cache is left to the processor's load."""
    d = cfg.data
    if d.max_images_per_prompt <= 0 or d.uses_demo:
        return
    from orlhf.config.train_config import ConfigError
    from orlhf.inputs.model_files import read_config

    config = read_config(d.pretrain)
    if config is not None and "vision_config" not in config:
        raise ConfigError(
            [
                f"--max_images_per_prompt {d.max_images_per_prompt}: --pretrain {d.pretrain} is not a vision-language "
                "model (its config.json has no vision_config); point --pretrain at one (`orlhf make-demo --vlm DIR` "
                "builds a tiny one) or drop --max_images_per_prompt."
            ]
        )


def check_weight_files(cfg: TrainConfig) -> None:
    """The safetensors files of every model folder the run loads (inputs/model_files.py: headers and sizes, no
    tensor read): a truncated or missing shard is a ConfigError (exit 2) naming the flag and the file, where a
    rank or an engine would fail in its init, after the start-up, without naming it."""
    from orlhf.config.roles import active_roles
    from orlhf.config.train_config import ConfigError
    from orlhf.inputs.model_files import weight_file_problem

    d, problems = cfg.data, []
    loaded = {model_path(cfg, role) for role in active_roles(cfg)}
    flags = {d.critic_pretrain: "--critic_pretrain", d.reward_pretrain: "--reward_pretrain", d.pretrain: "--pretrain"}
    for folder, flag in flags.items():  # a folder given to two flags is read once
        readable = folder in loaded and folder is not None and Path(folder).expanduser().is_dir()
        problem = weight_file_problem(folder) if readable else None
        if problem:
            problems.append(f"{flag} {folder}: {problem}; re-save or re-download the model folder.")
    if problems:
        raise ConfigError(problems)


def check_value_heads(cfg: TrainConfig) -> None:
    """The reward model's and critic's value heads, checked from their files before Ray starts (a wrong
    --value_head_prefix fails in a second, not after the start-up); the workers load the same way."""
    if not (cfg.has_reward_model or cfg.has_critic):
        return
    from orlhf.inputs.head_files import check_head

    d = cfg.data
    if cfg.has_reward_model:
        check_head(d.reward_pretrain, d.value_head_prefix, required=True)
    if cfg.has_critic:
        check_head(model_path(cfg, "critic"), d.value_head_prefix, required=False)


def check_moe_for_aux_loss(cfg: TrainConfig, run_logs=None) -> None:
    """--aux_loss_coef needs a mixture-of-experts actor (its transformers config has output_router_logits): a
    ConfigError (exit 2) otherwise, where OpenRLHF would fail at the first train step."""
    if cfg.ppo.aux_loss_coef <= 0:
        return
    if run_logs is not None:
        run_logs.route_transformers()  # before transformers is imported here
    from transformers import AutoConfig

    from orlhf.config.train_config import ConfigError

    config = AutoConfig.from_pretrained(cfg.data.pretrain)
    if not hasattr(config.get_text_config(), "output_router_logits"):
        raise ConfigError(
            [
                f"--aux_loss_coef {cfg.ppo.aux_loss_coef}: {cfg.data.pretrain} ({config.model_type}) is not a "
                "mixture-of-experts model, so there is no router loss; drop the flag."
            ]
        )


def check_replayed_family(cfg: TrainConfig) -> None:
    """--router_replay needs an actor of a mixture-of-experts family whose routing orlhf records and replays
    (inputs/model_files.py REPLAYED_MOE_FAMILIES): a ConfigError (exit 2) naming the model's type otherwise."""
    mode = cfg.ppo.router_replay
    if mode == "disabled":
        return
    from orlhf.config.train_config import ConfigError
    from orlhf.inputs.model_files import REPLAYED_MOE_FAMILIES, read_config

    config = read_config(cfg.data.pretrain)
    if config is None or config.get("model_type") in REPLAYED_MOE_FAMILIES:  # no config.json: the load will tell
        return
    raise ConfigError(
        [
            f"--router_replay {mode} routes a mixture-of-experts actor's tokens to recorded experts, and --pretrain "
            f"{cfg.data.pretrain} ({config.get('model_type')}) is not of a family orlhf replays "
            f"({', '.join(REPLAYED_MOE_FAMILIES)}): drop --router_replay, or train such a model (`orlhf make-demo "
            "--moe DIR` builds a tiny Qwen2-MoE)."
        ]
    )


def check_lora_targets(cfg: TrainConfig) -> None:
    """--target_modules against the actor's (and the critic's) model, built on the meta device: the names that match
    no Linear layer are one ConfigError (exit 2) naming each and listing the model's, before any rank loads it."""
    if not cfg.lora.enabled:
        return
    from orlhf.config.roles import active_roles
    from orlhf.config.train_config import ConfigError
    from orlhf.workers.lora import LoraTargetError, check_folder_targets

    found: dict[str, list[str]] = {}  # the actor's and the critic's at once; one line for both when they agree
    for role in ("actor", "critic"):
        if role in active_roles(cfg):
            try:
                check_folder_targets(model_path(cfg, role), cfg.lora.targets, causal_lm=role == "actor")
            except LoraTargetError as e:
                found.setdefault(str(e), []).append(f"{role}: {model_path(cfg, role)}")
    if found:
        raise ConfigError([f"{problem} ({', '.join(where)})" for problem, where in found.items()])
    log.info(
        "LoRA rank %d on %s: the reference is the actor's base weights (adapter off), no reference group%s; "
        "engines get the adapted modules merged after every update",
        cfg.lora.lora_rank,
        cfg.lora.target_modules,
        " (--colocate_actor_ref has nothing to colocate)" if cfg.placement.colocate_actor_ref else "",
    )
