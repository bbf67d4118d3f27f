"""Flat flag values -> TrainConfig: the flag table read from config/train_config.py's dataclasses, the built-in
demo's preset, parsing (parse_config) and parsing + validation (build_config).

    {"actor_learning_rate": 5e-4, ...} (by flag name; `explicit`: the flags the user gave)
        --parse_config--> DEMO_PRESET for the flags not given (only without --pretrain) --> TrainConfig
        --build_config--> also validation.validate (ConfigError listing every problem)

Like config/train_config.py, nothing here imports torch, ray, deepspeed or vllm (`orlhf --help` stays fast).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from orlhf.config.train_config import SECTIONS, TrainConfig
from orlhf.config.validation import validate

# Values the built-in demo runs with unless the user sets the flag: a tiny model on 2 CPU cores learns its task
# in minutes with these, while OpenRLHF's defaults (1024-token generations, lr 1e-6) would not move it.
# Applied only to flags the user did not give, only without --pretrain, and printed when applied.
DEMO_PRESET: dict[str, Any] = {
    "prompt_max_len": 64,
    "generate_max_len": 24,
    "rollout_batch_size": 64,
    "train_batch_size": 64,
    "micro_train_batch_size": 16,
    "micro_rollout_batch_size": 32,
    "actor_learning_rate": 5e-4,
    "critic_learning_rate": 1e-3,
    "lr_warmup_ratio": 0.0,
    "num_episodes": 10,  # enough steps for the demo's reward curve to climb, short enough for a laptop
    "enforce_eager": True,  # vLLM's compile costs start-up a tiny model never wins back; eager is fast for it
    "input_key": "prompt",
    "label_key": "label",
}


def flag_fields() -> list[tuple[str, str, dataclasses.Field, Any]]:
    """(section attr, flag name, field, resolved type) for every flag, in --help order."""
    out = []
    for attr, cls, _panel in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append((attr, f.metadata.get("flag") or f.name, f, hints[f.name]))
    return out


def build_config(flags: dict[str, Any], explicit: frozenset[str] | set[str] = frozenset()) -> TrainConfig:
    """Flat flag values (by flag name) -> validated TrainConfig, --device as given (maybe "auto"). Raises
    ConfigError listing every problem. A run starts from resolve.finish_config instead, which also resolves the
    device (validating once, against it) and the demo's paths; `orlhf plan` and tests use this one."""
    cfg = parse_config(flags, explicit)
    validate(cfg, explicit)
    return cfg


def parse_config(flags: dict[str, Any], explicit: frozenset[str] | set[str] = frozenset()) -> TrainConfig:
    """Flat flag values (by flag name) -> TrainConfig, not validated yet (build_config / finish_config do).

    `explicit` names the flags the user gave; only the others may take the demo preset (no --pretrain).
    Unknown flag names are a programming error (KeyError), not a user error.
    """
    known = {name for _, name, _, _ in flag_fields()}
    unknown = set(flags) - known
    if unknown:
        raise KeyError(f"unknown flags: {sorted(unknown)}")
    values = dict(flags)
    if values.get("pretrain") is None:
        for name, v in DEMO_PRESET.items():
            if name not in explicit:
                values[name] = v
    if values.get("max_len") is not None and "generate_max_len" not in explicit:
        values["generate_max_len"] = values["max_len"]  # OpenRLHF: max_len - prompt length is the only cap
    sections: dict[str, dict[str, Any]] = {attr: {} for attr, _, _ in SECTIONS}
    for attr, name, f, _ in flag_fields():
        if name in values:
            v = values[name]
            sections[attr][f.name] = tuple(v) if isinstance(v, list) else v
    return TrainConfig(**{attr: cls(**sections[attr]) for attr, cls, _ in SECTIONS})


def demo_preset_applied(flags: dict[str, Any], explicit: frozenset[str] | set[str]) -> dict[str, Any]:
    """The preset values build_config applies for these flags (for printing)."""
    if flags.get("pretrain") is not None:
        return {}
    return {k: v for k, v in DEMO_PRESET.items() if k not in explicit}


def demo_preset_flags(**overrides: Any) -> str:
    """DEMO_PRESET (with `overrides`) as command-line flags, a switch bare: what `orlhf make-demo` prints."""
    preset = {**DEMO_PRESET, **overrides}
    return " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in preset.items() if v is not False)


def flag_values(cfg: TrainConfig) -> dict[str, Any]:
    """{flag name: value} of every flag of `cfg`, in flag_fields() order."""
    return {name: getattr(getattr(cfg, attr), f.name) for attr, name, f, _ in flag_fields()}


def flag_defaults() -> dict[str, Any]:
    """{flag name: its declared default}."""
    return {name: f.default for _, name, f, _ in flag_fields()}
