"""The `orlhf` command. For `orlhf train-ppo` the run's answer to SIGTERM and Ctrl-C (launch/stop_signals.py) is in
place before anything else is imported (typer, the flag tables, the demo's build), so that a signal at any instant
of a run ends it with its line; only the interpreter's own start comes before. It stays in place to the process's
last instant: the command exits through stop_signals.exit_keeping_handlers, so that a signal that comes after the
run's line (the second of two, sent as the checkpoint the first let finish was written) still ends it with the
line's code."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] != ["train-ppo"]:
        _cached_import_tables()
        from orlhf.cli import main as cli

        return cli()
    from orlhf.launch.stop_signals import RunStop, exit_keeping_handlers

    with RunStop.for_run(until_exit=True):
        try:
            _cached_import_tables()
            from orlhf.cli import main as cli

            cli()
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except Exception:  # noqa: BLE001 - printed as Python would, then the same exit as any other
            import traceback

            traceback.print_exc()
            code = 1
    exit_keeping_handlers(code)


def _cached_import_tables() -> None:
    """transformers' lazy-module tables from their cache once a command imports it (storage/import_tables.py)."""
    from orlhf.storage.import_tables import install

    install()


def _exit_code(code) -> int:
    """SystemExit's code as the process's exit status, as Python's own exit makes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
