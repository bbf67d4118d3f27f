"""Secrets never leave this process: the config and command line that go to W&B (or any dump) are redacted."""

from __future__ import annotations

from typing import Any

from orlhf.config.flags import flag_fields
from orlhf.config.train_config import TrainConfig, settings_of

# Flags whose value can be a secret (OpenRLHF's `--use_wandb KEY`). Their values never leave this process: the
# config sent to W&B and any other dump goes through public_config(); argv through redact_argv().
SECRET_FLAGS = ("use_wandb",)
REDACTED = "<redacted>"


def public_config(cfg: TrainConfig) -> dict[str, Any]:
    """The settings (train_config.settings_of: dataclasses.asdict without records) with every non-empty secret value
    replaced by REDACTED."""
    out = settings_of(cfg)
    for attr, flag, f, _ in flag_fields():
        if flag in SECRET_FLAGS and out[attr][f.name]:
            out[attr][f.name] = REDACTED
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """A copy of a command line with the values of SECRET_FLAGS replaced (`--use_wandb KEY`, `--use-wandb=KEY`)."""
    out, hide_next = [], False
    for tok in argv:
        name = tok[2:].split("=", 1)[0].replace("-", "_") if tok.startswith("--") else None
        if hide_next and not tok.startswith("-"):
            out.append(REDACTED)
        elif name in SECRET_FLAGS and "=" in tok:
            out.append(f"{tok.split('=', 1)[0]}={REDACTED}" if tok.split("=", 1)[1] else tok)
        else:
            out.append(tok)
        hide_next = name in SECRET_FLAGS and "=" not in tok
    return out
