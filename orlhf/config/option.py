"""`opt`: a config field that is also a command-line flag. Its metadata carries the flag's name, help, choices and
metavar; cli.py builds the train-ppo command from these fields, so the flag surface and the config cannot drift apart.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, flag: str | None = None, choices: tuple | None = None, metavar: str | None = None):
    """A config field that is also a command-line flag. `flag` defaults to the field name."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in a frozen config")
    return field(default=default, metadata=meta)
