"""The train-ppo flags as Typer options, and the two views of --help over them (config/panels.py's table):

    `--help`      the first-run flags of the six task panels, each with its one-line help, and a closing line
                  naming --help-all (the other options exist and parse, hidden from this view)
    `--help-all`  every flag in every panel with its full help (an eager option that unhides them and prints)

cli.py gives each train-ppo-like command (train-ppo, plan, benchmark scripts built on the same flags) its signature
with with_train_flags. Typer and rich are imported here, never torch.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Literal, Optional

import typer

from orlhf.config import panels as P
from orlhf.config.flags import flag_fields

FIRST_RUN_EPILOG = "These are the flags a first run needs: --help-all shows every flag, grouped by task."
ALL_EPILOG = "docs/flags.md explains every flag, grouped by the same panels."


def _option_for(name: str, f, typ: Any):
    """A Typer option for one config field, accepting --name_with_underscores and --name-with-dashes (through
    normalize_flag). `--help` shows the first-run flags with their one-line help; --help-all every flag in full."""
    first_run = name in P.FIRST_RUN
    kwargs: dict[str, Any] = {
        "help": P.FIRST_RUN.get(name) or f.metadata["help"],
        "rich_help_panel": P.PANEL_OF[name],
        "show_default": typ is not bool,
        "hidden": not first_run,
    }
    if f.metadata.get("metavar"):
        kwargs["metavar"] = f.metadata["metavar"]
    return typer.Option(f.default, f"--{name}", **kwargs)


def _annotation_for(f, typ: Any) -> Any:
    """The field's type, narrowed to a Literal of its choices so --help lists them and Typer checks them."""
    choices = f.metadata.get("choices")
    if not choices:
        return typ
    lit = Literal[tuple(choices)]  # type: ignore[valid-type]
    return Optional[lit] if f.default is None else lit


def _show_every_flag(ctx: typer.Context, value: bool) -> None:
    """--help-all: the command's help with every flag, each with its full help."""
    if not value or ctx.resilient_parsing:
        return
    full = {name: f.metadata["help"] for _, name, f, _ in flag_fields()}
    for param in ctx.command.params:
        param.hidden = False
        param.help = full.get(param.name or "", param.help)  # type: ignore[attr-defined]
    ctx.command.epilog = ALL_EPILOG
    typer.echo(ctx.get_help(), color=ctx.color)
    raise typer.Exit()


HELP_ALL = (
    bool,
    typer.Option(
        False, "--help-all", help="Show every flag.", is_eager=True, expose_value=False, callback=_show_every_flag
    ),
)


def with_train_flags(fn: Callable[..., Any], extra: Optional[dict[str, tuple[Any, Any]]] = None) -> Callable[..., Any]:
    """Give `fn(**flags)` a signature with one keyword parameter per config flag in config/panels.py's order, the
    command's `extra` options ({name: (type, typer.Option)}) and --help-all, for Typer to read."""
    extra = dict(extra or {})
    fields = {name: (f, typ) for _, name, f, typ in flag_fields()}
    options = {}
    for name in P.ordered_flags():
        if name in fields:
            f, typ = fields[name]
            options[name] = (_annotation_for(f, typ), _option_for(name, f, typ))
        elif name in extra:
            options[name] = extra.pop(name)
    options.update({**extra, "help_all": HELP_ALL})
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=o, annotation=t) for n, (t, o) in options.items()
    ]
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = {"ctx": typer.Context, **{n: t for n, (t, _) in options.items()}}
    return fn


def keep_flag_names_whole() -> None:
    """At 80 columns rich shrinks every column of Typer's option tables to fit and cuts long flag names with '…'
    (--vllm_gpu_memory_utilizat…). Typer builds those tables with rich's Table: hand it one whose name columns
    (all but the type and help columns) never wrap, so the help text wraps instead (long words fold)."""
    import typer.rich_utils as ru
    from rich.table import Table

    class OptionsTable(Table):
        def add_row(self, *renderables, **kwargs):
            super().add_row(*renderables, **kwargs)
            for column in self.columns[:-2]:
                column.no_wrap = True
            for item in getattr(renderables[-1], "renderables", ()):  # the help cell: Columns of Text parts
                if hasattr(item, "overflow"):
                    item.overflow = "fold"  # a word longer than the column folds, never cut with '…'

    ru.Table = OptionsTable
