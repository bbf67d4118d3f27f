"""The rules of config/validation.py about what a run reads and writes: models, prompts, the reward source, eval
data, the lengths the actor's positions allow, the run and checkpoint folders.

Each rule appends one message per problem to `out`, naming the flags and the fix; none reads more than a path's
existence, its permissions or a folder's config.json.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from orlhf.config.train_config import TrainConfig
from orlhf.inputs.model_files import max_positions, read_config

# "org/name" on the HF hub; allowed for model paths when the hub is reachable (HF_HUB_OFFLINE unset).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")


def template_error(tpl: str) -> Optional[str]:
    """The template is applied with str.format (as OpenRLHF does), so any other brace must be doubled: the message
    when it cannot be, else None."""
    try:
        tpl.format("x")
    except (KeyError, IndexError, ValueError) as e:
        return (
            f"--input_template {tpl!r}: braces other than the one '{{}}' ({type(e).__name__}: {e}); "
            "write literal braces doubled, '{{' and '}}'."
        )
    return None


def reward_source(cfg: TrainConfig, out: list[str]) -> None:
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


def paths(cfg: TrainConfig, out: list[str]) -> None:
    d = cfg.data
    offline = _offline()
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


def prompt_mix_and_heads(cfg: TrainConfig, out: list[str]) -> None:
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


def evaluation(cfg: TrainConfig, out: list[str]) -> None:
    e = cfg.eval
    if e.eval_steps != -1 and e.eval_steps < 1:
        out.append(f"--eval_steps must be -1 (after the last step only) or >= 1 (got {e.eval_steps}).")
    if e.eval_n_samples_per_prompt < 1:
        out.append(f"--eval_n_samples_per_prompt must be >= 1 (got {e.eval_n_samples_per_prompt}).")
    if e.eval_temperature < 0:
        out.append(f"--eval_temperature must be >= 0 (0: greedy; got {e.eval_temperature}).")
    try:
        _ = e.best_metric  # raises on a key it cannot read
    except ValueError as err:
        out.append(f"{err}.")
    if e.eval_dataset is None:
        best = (e.best_metric_key or "").strip().lower() not in ("", "none")  # OpenRLHF's default / off: fine
        given_flags = ("--eval_steps", e.eval_steps != -1), ("--best_metric_key", best)
        for flag, given in (*given_flags, ("--eval_before_train", e.eval_before_train)):
            if given:
                out.append(f"{flag} needs --eval_dataset (held-out prompts to evaluate on).")
    else:
        path = Path(e.eval_dataset).expanduser()
        offline = _offline()
        if not path.exists() and (offline or not _HUB_ID.match(e.eval_dataset)):
            out.append(f"--eval_dataset {e.eval_dataset}: no such file or folder.")


def lengths(cfg: TrainConfig, out: list[str]) -> None:
    """--prompt_max_len + --generate_max_len, capped by --max_len (the engines' max_model_len: rollout/engine.py's
    engine_config), against the positions in the actor's config.json (inputs/model_files.max_positions): vLLM
    refuses a longer max_model_len in the engine's init, after the whole start-up. VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
    makes vLLM take it (positions past the model's are garbage or NaN), and this rule with it."""
    if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return
    p, d = cfg.ppo, cfg.data
    if d.uses_demo:
        from orlhf.demo.builder import MAX_POSITIONS

        limit, key, model = MAX_POSITIONS, "max_position_embeddings", "the built-in demo model"
    else:
        config = read_config(d.pretrain)
        found = max_positions(config) if config is not None else None
        if found is None:  # a hub id, or no key to read: vLLM takes the length it is given
            return
        (limit, key), model = found, f"--pretrain {d.pretrain}"
    pair = p.prompt_max_len + p.generate_max_len
    if min(pair, p.max_len or pair) <= limit:
        return
    where = f"past the {limit} positions of {model} ({key} in its config.json)"
    if p.max_len is not None and p.max_len < pair:
        also = " and --prompt_max_len below it" if p.prompt_max_len >= limit else ""
        out.append(f"--max_len {p.max_len} is {where}: lower --max_len to {limit} or less{also}.")
        return
    prompt = p.prompt_max_len if p.prompt_max_len <= limit // 2 else max(1, p.prompt_max_len * limit // pair)
    out.append(
        f"--prompt_max_len {p.prompt_max_len} + --generate_max_len {p.generate_max_len} = {pair} tokens is {where}: "
        f"lower them to add up to {limit} or less, e.g. --prompt_max_len {prompt} --generate_max_len {limit - prompt}."
    )


def output_folders(cfg: TrainConfig, out: list[str]) -> None:
    """--save_path and the checkpoint folder (--ckpt_path, else <save_path>/checkpoints_ppo): folders this run can
    create and write in, checked on the machine the run starts from (the run locks them first thing)."""
    lg = cfg.logging
    problem = folder_problem(lg.save_path)
    if problem:
        out.append(f"--save_path {lg.save_path}: {problem}; pass a folder you can write in (created if missing).")
    elif lg.ckpt_path is None:
        problem = folder_problem(lg.checkpoint_dir)
        if problem:
            out.append(f"--save_path {lg.save_path}: its checkpoint folder {problem}; move it or pass --ckpt_path.")
    if lg.ckpt_path is not None:
        problem = folder_problem(lg.ckpt_path)
        if problem:
            out.append(f"--ckpt_path {lg.ckpt_path}: {problem}; pass a folder you can write in (created if missing).")


def folder_problem(folder: str) -> Optional[str]:
    """Why `folder` cannot be a folder this process creates (parents included) and writes in, else None: it, or
    the nearest of its parents that exists, is not a folder, or is not writable. Creates nothing."""
    path = Path(folder).expanduser().absolute()
    nearest = path
    while not (nearest.exists() or nearest.is_symlink()) and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        if nearest == path:
            return f"{path} is a file, not a folder"
        return f"{nearest} is a file, so no folder can be made in it"
    if not os.access(nearest, os.W_OK | os.X_OK):
        if nearest == path:
            return f"{path} is not writable here (read-only)"
        return f"{nearest}, where it would be made, is not writable here (read-only)"
    return None
