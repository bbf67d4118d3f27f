"""A train-ppo / plan command line before Typer reads it:

    argv --OpenRLHF's spellings rewritten to orlhf's flags (config/openrlhf.py)--> a bare optional-value flag given
    its empty value --> (argv Typer parses, {orlhf flag: the OpenRLHF spelling that set it})

The spellings travel to config/provenance.py, which names them as the source of those values. Nothing here imports
Typer or torch: cli.py calls prepare() first thing.
"""

from __future__ import annotations

from orlhf.config.flags import flag_fields
from orlhf.config.openrlhf import STAR, translate_spelled

# Commands whose flags are train-ppo's (OpenRLHF's spellings apply to them).
TRAIN_COMMANDS = ("train-ppo", "plan")
# Flags whose value is optional: OpenRLHF scripts pass `--use_wandb KEY` / `--use_tensorboard DIR`, others
# the bare flag. A bare one gets the value "" (on, no key/dir) before Typer parses the line.
OPTIONAL_VALUE_FLAGS = ("use_wandb", "use_tensorboard")
# Flags that take a list, space-separated as OpenRLHF's nargs="*" or comma-separated: one value for Typer.
LIST_FLAGS = ("target_modules",)


def normalize_flag(token: str) -> str:
    """--actor-num-nodes and --actor_num_nodes are the same flag (OpenRLHF scripts use underscores)."""
    return token.replace("-", "_")


def prepare(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """`orlhf` arguments (the command first) -> (arguments for Typer, {orlhf flag: OpenRLHF spelling used}).
    Raises openrlhf.CompatError listing a refused or conflicting OpenRLHF flag."""
    spellings: dict[str, str] = {}
    if args and args[0] in TRAIN_COMMANDS:
        flags, spellings = translate_spelled(args[1:], native_arity())
        args = args[:1] + flags
    return fill_optional_values(args), spellings


def fill_optional_values(argv: list[str]) -> list[str]:
    out = []
    for i, tok in enumerate(argv):
        out.append(tok)
        if tok.startswith("--") and normalize_flag(tok[2:]) in OPTIONAL_VALUE_FLAGS:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("-"):
                out.append("")
    return out


def native_arity() -> dict[str, int]:
    """How many values each orlhf flag takes: 0 for switches, 2 for ranges, -1 (any) for lists, else 1."""
    out = {}
    for _, name, _, typ in flag_fields():
        out[name] = 0 if typ is bool else 2 if getattr(typ, "__origin__", None) is tuple else 1
    out.update({name: STAR for name in LIST_FLAGS})
    return out
