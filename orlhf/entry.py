"""The `orlhf` command. For `orlhf train-ppo` the run's answer to SIGTERM and Ctrl-C (launch/stop_signals.py) is in
place before anything else is imported (typer, the flag tables, the demo's build), so that a signal at any instant
of a run ends it with its line; only the interpreter's own start comes before."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] != ["train-ppo"]:
        from orlhf.cli import main as cli

        return cli()
    from orlhf.launch.stop_signals import RunStop

    with RunStop.for_run():
        from orlhf.cli import main as cli

        return cli()
