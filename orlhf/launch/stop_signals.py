"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, `kill`) while the run trains: finish the step in progress,
save a checkpoint there, stop, and say what was kept and how to resume.

    first signal   -> controller.stop_signal = "SIGTERM" (said in one line) -> the loop ends at the step boundary
                      (Controller.should_stop) and saves there (save_at_stop) -> launch/run.py skips the export,
                      tears down, and report_stop says what was kept; exit 128 + the signal's number
    second signal  -> KeyboardInterrupt at once, without a checkpoint: the CLI says "interrupted", exit 130

Installed only around Controller.fit(): during start-up Python's Ctrl-C and Ray's SIGTERM handler stop at once, as
after it. A SIGINT the parent ignores (a background job) stays ignored. A step takes what it takes: where a
scheduler kills soon after its SIGTERM, --save_steps keeps checkpoints along the way.
"""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("orlhf")


@contextmanager
def stop_on_signals(controller) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM ask `controller` to stop at the next step boundary (module docstring)."""

    def handler(signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if controller.stop_signal is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        controller.stop_signal = name
        log.warning(
            "%s: stopping after step %d (the one in progress) with a checkpoint there; %s again stops at once, "
            "without one",
            name,
            controller.step_index + 1,
            "Ctrl-C" if signum == signal.SIGINT else name,
        )

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def report_stop(controller) -> int:
    """Say, in one line, where a signal stopped the run and what it kept; returns the exit code, 128 + signal."""
    from orlhf.storage.checkpoint_format import step_dir_name
    from orlhf.trainer.run_state import foreign_checkpoint

    name, step, mgr = controller.stop_signal, controller.step_index, controller.checkpoints
    newest = mgr.latest() if mgr is not None else None
    if newest is not None and newest == foreign_checkpoint(mgr):
        newest = None  # another run's: not this run's to resume
    if newest is not None and newest.name == step_dir_name(step):
        kept = f"checkpoint {newest} kept; run the same command with --load_checkpoint to continue from it"
    elif newest is not None:
        kept = (
            f"no checkpoint of this step, the newest is {newest}; run the same command with --load_checkpoint to "
            "continue from it (the steps after it are trained again)"
        )
    else:
        kept = "no checkpoint kept: a new run starts from the beginning"
    log.warning("interrupted by %s after step %d: %s", name, step, kept)
    return 128 + int(signal.Signals[name])
