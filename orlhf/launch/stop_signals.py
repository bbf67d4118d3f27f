"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, `kill`) at any phase of a run: it stops, and its last line
says in which phase, what is kept and the command to continue; the exit code is 128 + the signal's number (130 for
Ctrl-C, 143 for SIGTERM).

    phase (Attempt.where)        first signal                              second signal (or two arriving at once)
    the start-up                 stop now: nothing trained yet             -
    a step                       finish the step, save it, stop            stop now, without that checkpoint
    the checkpoint of a step     finish writing it, stop                   stop now: the checkpoint is not written
    the restart (a lost process) stop now: the newest checkpoint stays     -
    the export                   finish it, then end as a finished run     stop now: the previous export stays
                                 (exit 0; the figures are skipped)
    tearing down (stopping)      said to be under way, the teardown goes on

"Stop now" raises RunStopped in the main thread wherever it waits: the run's processes and placement groups are torn
down as after any error (launch/run.py), the local Ray cluster's processes are waited for (ray_start.end_ray), and
only then is the line written. A SIGINT the parent ignores (a background job) stays ignored.

Installed for the whole run (RunStop.installed, launch/run.py's train_ppo). ray.init puts its own SIGTERM handler
in (sys.exit(15): rc 15, no line), so run_locked takes SIGTERM back once Ray is up (RunStop.take_back); Ray's C++
failure handler in this process, which printed a stack for a SIGTERM, is never installed (ray_start.connect_ray).
Python calls a handler once for all the signals that arrived while the main thread waited in C code (Ray's waits),
so two quick Ctrl-C would count as one: a wakeup pipe (signal.set_wakeup_fd) gets a byte for each arrival, and the
handler counts them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

log = logging.getLogger("orlhf")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESTART, STOPPING = "restart", "stopping"


class RunStopped(KeyboardInterrupt):
    """A signal stopped the run at once. A KeyboardInterrupt, so that Ray's waits (which turn a KeyboardInterrupt
    raised by a handler into one of their own) and every `except Exception` on the way let it through."""


class RunStop:
    """The run's answer to SIGINT and SIGTERM (module docstring). run.py tells it the attempt in progress (`attempt`,
    a launch/restart.Attempt: its phase and controller), the run's checkpoints once read, and a restart under way."""

    def __init__(self):
        self.attempt: Any = None  # the attempt in progress; None before the first one starts
        self.checkpoints: Any = None  # the run's CheckpointManager, once the inputs are read
        self.phase: Optional[str] = None  # RESTART or STOPPING; None: the attempt's phase
        self.signal: Optional[str] = None  # the first signal's name
        self.where = ""  # where the signal that decided the stop came ("during step 7")
        self.at_once = False  # it stopped at once (RunStopped raised)
        self.forced = False  # ... by a second signal, in a phase the first one let finish
        self._pipe: Optional[tuple[int, int]] = None
        self._previous: dict = {}

    @classmethod
    @contextmanager
    def installed(cls) -> Iterator["RunStop"]:
        """A RunStop handling SIGINT and SIGTERM inside; the previous handlers put back on leaving. Outside the main
        thread (where Python lets no handler be set) it handles nothing."""
        stop = cls()
        main = threading.current_thread() is threading.main_thread()
        if main:
            stop._open_pipe()
        for sig in SIGNALS if main else ():
            if signal.getsignal(sig) is not signal.SIG_IGN:
                stop._previous[sig] = signal.signal(sig, stop._on_signal)
        try:
            yield stop
        finally:
            for sig, old in stop._previous.items():
                signal.signal(sig, old)
            stop._close_pipe()

    def take_back(self) -> None:
        """Handle SIGINT and SIGTERM here again after a library replaced the handlers (ray.init's SIGTERM)."""
        for sig in self._previous:
            signal.signal(sig, self._on_signal)

    def follow(self, attempt) -> None:
        """`attempt` starts (the first, or the next after a restart)."""
        self.attempt, self.phase = attempt, (self.phase if self.phase == STOPPING else None)

    # ---- the handler -------------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        arrived = self._arrivals()
        if self.phase == STOPPING or (self.attempt is not None and self.attempt.phase == "done"):
            log.warning("%s: the run is ending; its processes are being shut down", name)
            return
        where, first, finishing = self.describe(), self.signal is None, self._finishes_first()
        if first:
            self.signal, self.where = name, where
        if not first or arrived > 1 or not finishing:
            self.where, self.phase, self.at_once, self.forced = where, STOPPING, True, finishing
            raise RunStopped(name)
        again = "Ctrl-C" if signum == signal.SIGINT else name
        controller = self.attempt.controller
        controller.stop_signal = name  # Controller.should_stop: the loop ends at the step boundary
        if self.attempt.phase == "export" or controller.saving:
            log.warning("%s %s: stopping once it is written; %s again stops at once, without it", name, where, again)
        else:
            log.warning(
                "%s %s: stopping after it, with a checkpoint there; %s again stops at once, without one",
                name,
                where,
                again,
            )

    def _finishes_first(self) -> bool:
        """Whether the phase in progress ends before the stop: a step, its checkpoint, the export."""
        return self.phase is None and self.attempt is not None and self.attempt.phase in ("training", "export")

    def describe(self) -> str:
        """Where the run is, in words: "during the start-up", "during step 7", "during the restart ...", ..."""
        attempt = self.attempt
        if self.phase == RESTART or (attempt is not None and attempt.number and attempt.phase == "start-up"):
            return "during the restart after a lost process"
        return attempt.where() if attempt is not None else "during the start-up"

    # ---- counting arrivals --------------------------------------------------------------------------------------
    def _open_pipe(self) -> None:
        """The wakeup pipe that counts arrivals; none where one is set already (an event loop's): signals then count
        one per handler call."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old != -1:
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        self._pipe = (r, w)

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(-1)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _arrivals(self) -> int:
        """SIGINT and SIGTERM arrivals since the last call (at least 1: this call's)."""
        if self._pipe is None:
            return 1
        data = b""
        try:
            while chunk := os.read(self._pipe[0], 256):
                data += chunk
        except BlockingIOError:
            pass
        return max(1, sum(byte in SIGNALS for byte in data))

    # ---- the end ------------------------------------------------------------------------------------------------
    def outcome(self, code: Optional[int]) -> Optional[int]:
        """After the teardown: when a signal stopped the run, its one line (where, what is kept, how to continue) and
        128 + the signal's number; `code` otherwise, also when a signal let the export finish (the line says so)."""
        if self.signal is None:
            return code
        if not self.at_once and self.where == "during the export" and code == 0:
            log.warning(
                "%s %s: it finished first, so the run is complete; nothing to continue", self.signal, self.where
            )
            return code
        how = f"at once by a second {self.signal}" if self.forced else f"by {self.signal}"
        unchanged = "the export was not written; " if self.where == "during the export" else ""
        log.warning("stopped %s %s: %s%s", how, self.where, unchanged, self.kept())
        return 128 + int(signal.Signals[self.signal])

    def kept(self) -> str:
        """This run's newest checkpoint and the command that continues from it."""
        from orlhf.storage.checkpoint import read_meta

        newest = self._newest()
        if newest is None:
            return "no checkpoint kept: run the same command to start again from the beginning"
        controller = self.attempt.controller if self.attempt is not None else None
        trained, saved = (controller.step_index if controller is not None else 0), int(read_meta(newest)["step"])
        if trained == saved:
            return f"checkpoint {newest} kept; run the same command with --load_checkpoint to continue from it"
        after = " (the steps after it are trained again)" if trained > saved else ""
        return (
            f"the newest checkpoint is {newest}; run the same command with --load_checkpoint to continue from it{after}"
        )

    def _newest(self):
        """This run's newest complete checkpoint (never another run's in the same folder), or None."""
        mgr = self.checkpoints
        if mgr is None:
            return None
        from orlhf.storage.checkpoint import read_meta

        return next((p for p in mgr.complete() if read_meta(p).get("run_id") == mgr.run_id), None)
