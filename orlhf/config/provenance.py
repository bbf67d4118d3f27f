"""The resolved configuration a run uses: every setting by flag name, its value and where the value came from.

A value passes several hands before a run starts (config/resolve.py):

    the command line --OpenRLHF spellings rewritten (config/openrlhf.py)--> flags --without --pretrain, the demo
    preset for the flags not given (config/flags.py)--> parsed --device auto resolved, the sync backend following
    it, --max_len capping --generate_max_len, the demo's paths filled in--> the finished TrainConfig

so each flag's source is one of:
    "default"              nobody set it: the flag's declared default
    "flag"                 the user gave it in orlhf's spelling (--actor_learning_rate, --actor-learning-rate)
    "openrlhf --SPELLING"  the user gave it in another OpenRLHF spelling, named (openrlhf --critic.max_norm,
                           openrlhf --param_dtype bf16)
    "demo preset"          the built-in demo's preset (no --pretrain, the flag not given)
    "derived"              resolution put a value there other than the one the steps before gave it (device,
                           sync backend, the demo's model, prompts and reward, --generate_max_len from --max_len)

How the sources travel: with_sources() records them on a copy of the finished TrainConfig, where the command line
is read (cli.parse_or_exit), in its declared TrainConfig.recorded_sources field (a record, not a setting). So the
launch code, which receives only the config, can write them (dump_resolved), while equality (compare=False),
settings_of, fingerprints and the config sent to W&B see the settings alone. A config built in code, not from a
command line, has none recorded: its non-default values read "not recorded".

The run folder keeps dump_resolved()'s JSON ({"flag": {"value": ..., "source": ...}} in panel order, secrets
redacted); read_resolved() reads it back to {flag: value}, which fingerprint.settings_fingerprint compares on resume.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from orlhf.config.flags import demo_preset_applied, flag_defaults, flag_values
from orlhf.config.panels import PANELS
from orlhf.config.redact import REDACTED, SECRET_FLAGS
from orlhf.config.train_config import TrainConfig

DEFAULT, FLAG, OPENRLHF, PRESET, DERIVED = "default", "flag", "openrlhf", "demo preset", "derived"
NOT_RECORDED = "not recorded"


def with_sources(
    cfg: TrainConfig, given: Mapping[str, Any], explicit: set[str] | frozenset[str], spellings: Mapping[str, str]
) -> TrainConfig:
    """A copy of the finished `cfg` with each flag's source recorded. `given`: the flag values it was finished from
    (by flag name, as the command line gave them or their defaults); `explicit`: the flags the user gave;
    `spellings`: {flag: the OpenRLHF spelling that set it} (config/command_line.prepare)."""
    preset, defaults = demo_preset_applied(dict(given), explicit), flag_defaults()
    sources = {}
    for flag, value in flag_values(cfg).items():
        if flag in explicit:
            source, start = (f"{OPENRLHF} {spellings[flag]}" if flag in spellings else FLAG), given[flag]
        elif flag in preset:
            source, start = PRESET, preset[flag]
        else:
            source, start = DEFAULT, defaults[flag]
        sources[flag] = source if _jsonable(value) == _jsonable(start) else DERIVED
    return dataclasses.replace(cfg, recorded_sources=tuple(sources.items()))  # a copy: `cfg` itself is unchanged


def sources_of(cfg: TrainConfig) -> dict[str, str]:
    """{flag: source} for every flag: as recorded, else "default" / "not recorded" (a config built in code)."""
    recorded, defaults = cfg.sources, flag_defaults()
    return {
        flag: recorded.get(flag) or (DEFAULT if _jsonable(value) == _jsonable(defaults[flag]) else NOT_RECORDED)
        for flag, value in flag_values(cfg).items()
    }


def resolved_config(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """{"flag": {"value": JSON value, "source": source}} for every setting, in panel order (config/panels.py), the
    value of a secret flag (--use_wandb KEY) redacted."""
    values, sources = flag_values(cfg), sources_of(cfg)
    out = {}
    for panel in PANELS:
        for flag in panel.flags:
            if flag in values:
                value = REDACTED if flag in SECRET_FLAGS and values[flag] else _jsonable(values[flag])
                out[flag] = {"value": value, "source": sources[flag]}
    return out


def render_resolved(cfg: TrainConfig) -> str:
    """resolved_config as a table a person reads: one block per panel, a row per flag (name, value, source)."""
    settings = resolved_config(cfg)
    lines = [
        "The resolved configuration: every setting, its value and its source",
        "(default, flag, openrlhf --SPELLING, demo preset or derived).",
    ]
    for panel in PANELS:
        rows = [
            (f"--{flag}", _shown(settings[flag]["value"]), settings[flag]["source"])
            for flag in panel.flags
            if flag in settings
        ]
        if rows:
            name_w = max(len(name) for name, _, _ in rows)
            value_w = min(max(len(value) for _, value, _ in rows), 24)  # a longer value (a path) pushes its source
            lines += ["", panel.title]
            lines += [f"  {name:<{name_w}}  {value:<{value_w}}  {source}" for name, value, source in rows]
    facts = derived_facts(cfg)
    name_w = max(len(name) for name, _ in facts)
    lines += ["", "Derived (what the settings above imply)"]
    lines += [f"  {name:<{name_w}}  {value}" for name, value in facts]
    return "\n".join(lines)


def derived_facts(cfg: TrainConfig) -> list[tuple[str, str]]:
    """What the settings imply that no single flag says, as --print_config ends with them: where checkpoints go,
    which models run besides the actor, and who generates (the rollout backend's record, config/rollout_backends.py)."""
    spec = cfg.rollout
    if cfg.reference_from_actor:
        reference = "none placed: the actor's ranks with the LoRA adapter off score it"
    elif cfg.has_reference:
        reference = "runs (a KL reads it)"
    else:
        reference = "none: no KL reads it (--init_kl_coef 0 without --use_kl_loss)"
    critic = "runs" if cfg.has_critic else f"none (--advantage_estimator {cfg.ppo.advantage_estimator})"
    shared = ", on the actor's devices" if cfg.engines_colocated else ""
    return [
        ("checkpoint folder", cfg.logging.checkpoint_dir),
        ("reference model", reference),
        ("critic", critic),
        ("reward model", "runs" if cfg.has_reward_model else "none (rewards from a function, a server or an agent)"),
        ("rollout backend", f"{cfg.rollout_name} (generation memory: {spec.memory})"),
        ("engines placed", f"{cfg.num_engines} ({spec.engine}{shared})" if spec.places_engines else "none"),
    ]


def dump_resolved(cfg: TrainConfig) -> str:
    """resolved_config as the JSON text a run folder keeps (read back with read_resolved)."""
    return json.dumps(resolved_config(cfg), indent=1) + "\n"


def read_resolved(path: str | Path) -> dict[str, Any]:
    """{flag: value} from a file dump_resolved wrote (pairs as lists, as fingerprint.settings_fingerprint keeps
    them). A flag added since the file was written is absent."""
    settings = json.loads(Path(path).read_text())
    return {flag: entry["value"] for flag, entry in settings.items()}


def resume_changes(saved: Mapping[str, Any], cfg: TrainConfig) -> list[str]:
    """The settings that matter on resume (config/fingerprint.py decides which) whose value differs between `saved`
    (read_resolved of the run folder being resumed) and `cfg`, one line each naming this run's source:
    "--actor_learning_rate: 1e-06 when saved, 0.0005 now (flag)". A flag the file lacks (added since) is skipped."""
    from orlhf.config.fingerprint import settings_fingerprint

    before, now, sources = settings_fingerprint(saved), settings_fingerprint(flag_values(cfg)), sources_of(cfg)
    return [
        f"{key}: {before[key]!r} when saved, {value!r} now ({sources[key[2:]]})"
        for key, value in now.items()
        if key in before and before[key] != value
    ]


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _shown(value: Any) -> str:
    """A value as a person writes it on the command line: on/off, none, pairs space-separated."""
    if value is True or value is False:
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return '""' if value == "" else str(value)
