"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, `kill`, `timeout`, `scancel`) at any instant of a run, sent
to the driver alone or to its whole process group, once or twice: the run ends within a bound, its last line says
in which phase, what is kept and the command to continue, and the exit code is 128 + the signal's number (130 for
Ctrl-C, 143 for SIGTERM; 0 when the export finished first).

    phase (Attempt.where)         first signal                                 second signal
    the start-up                  stop now: nothing trained yet                 -
    a step                        finish it and save it if that takes at most   stop now, without that checkpoint
                                  --stop_grace_s, else stop now
    the checkpoint of a step      finish writing it (same bound), stop          stop now: the checkpoint is not written
    the restart (a lost process)  stop now: the newest checkpoint stays         -
    the export                    finish it (same bound), then end as a         stop now: the previous export stays
                                  finished run (exit 0, figures skipped)
    the teardown after the end    said; the teardown goes on                    stop now
The bound: --stop_grace_s for what a first signal lets finish, END_S more for the teardown after it; past either,
the run stops now. "Stop now" takes at most KILL_S more.

How, so that a stop can neither hang nor be lost:
- The handlers Python runs in the main thread do nothing: a handler that raised could land inside an import (whose
  module lock, left held, once hung the inputs thread's `import torch` and the driver's join of it) or in the middle
  of any cleanup. CPython's C handler writes one byte per arrival into a wakeup pipe (signal.set_wakeup_fd) whatever
  the main thread is doing; the "orlhf-stop" thread reads it, so every arrival counts exactly once and two quick
  Ctrl-C count as two.
- A first signal in a phase that may finish sets controller.stop_signal: the loop ends at the step boundary with
  a checkpoint (trainer/run_state.py), and the main thread tears down as after any run. The stop thread keeps the
  bound.
- "Stop now" happens in the stop thread, not the main thread: every process the run started (the local Ray
  cluster's processes, rank workers, vLLM engines and what they started) gets SIGTERM, then SIGKILL after KILL_S / 2;
  then the one line, and the process exits (os._exit). Checkpoints and exports are written aside and renamed into
  place, so one cut short leaves the previous one whole. On a cluster this run joined, Ray ends the run's actors and
  placement groups when the driver goes. Meanwhile only this thread writes to the terminal (what the main thread
  logs as its calls fail goes to driver.log) and Ray's C++ lines go to driver.log.
- ray.init installs its own SIGTERM handler (sys.exit(15): rc 15, no line); ray_start.connect_ray keeps it from
  replacing this one, and starts the local cluster's processes in a process group of their own, so that a signal to the
  run's process group (a terminal's Ctrl-C, `timeout`, SLURM) reaches the driver only and the cluster stays up for
  the stop the driver chooses (nothing waits on a GCS that the same signal killed).
A SIGINT the parent ignores (a background job) stays ignored.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from orlhf.launch.stop_line import StopLine

log = logging.getLogger("orlhf")
SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESTART = "restart"
GRACE_S = 15.0  # --stop_grace_s's default, until the run's flags are parsed
END_S = 10.0  # the teardown after what a first signal let finish (end_ray's waits included)
KILL_S = 4.0  # a stop now: SIGTERM to every process of the run, SIGKILL to what is left after half of it
_QUIT = b"\0"  # written into the wakeup pipe by the main thread when the run is over: not a signal's number


class RunStop(StopLine):
    """The run's answer to SIGINT and SIGTERM (module docstring). run.py tells it the attempt in progress (`attempt`,
    a launch/restart.Attempt: its phase and controller), the run's checkpoints once read, and a restart under way.
    `exit` ends the process (os._exit; tests pass their own), `kill` ends the run's processes."""

    active: Optional["RunStop"] = None  # the one installed in this process, if any

    def __init__(
        self, grace_s: float = GRACE_S, exit: Optional[Callable[[int], Any]] = None, kill: Optional[Callable] = None
    ):
        self.grace_s = grace_s
        self.attempt: Any = None  # the attempt in progress; None before the first one starts
        self.checkpoints: Any = None  # the run's CheckpointManager, once the inputs are read
        self.phase: Optional[str] = None  # RESTART while a lost attempt is torn down; None: the attempt's phase
        self.signal: Optional[str] = None  # the first signal's name
        self.where = ""  # where the signal that decided the stop came ("during step 7")
        self.at_once = False  # it stopped now (the stop thread ended the run)
        self.forced = False  # ... by a second signal
        self._exit, self._kill = exit or _exit_process, kill or _kill_run_processes
        self._grace_end: Optional[float] = None  # what a first signal let finish must have finished by then
        self._final_end: Optional[float] = None  # ... and the run must have ended by then
        self._late: Optional[str] = None  # a signal that came while a complete run was ending
        self._code: Optional[int] = None  # the exit code the main thread's outcome() returned
        self._reason = ""  # why a stop now came without a second signal ("it did not end within ...")
        self._ended = threading.Event()  # the last line is written (by whichever thread got there first)
        self._end_lock = threading.Lock()
        self._gone = threading.Event()
        self._pipe: Optional[tuple[int, int]] = None
        self._thread: Optional[threading.Thread] = None
        self._previous: dict = {}

    @classmethod
    @contextmanager
    def installed(cls, grace_s: float = GRACE_S, until_exit: bool = False, **kwargs) -> Iterator["RunStop"]:
        """A RunStop handling SIGINT and SIGTERM inside; the previous handlers put back on leaving. Outside the main
        thread (where Python lets no handler be set) it handles nothing. `until_exit` (the command's): they stay
        after leaving, through the interpreter's exit, so that a signal after the run's line (the second of two, sent
        as its checkpoint was finished) ends the process with the line's code, never by the default action."""
        stop = cls(grace_s, **kwargs)
        _preload()  # what a stop needs, imported now: never an import in the stop thread while another thread imports
        if threading.current_thread() is threading.main_thread() and stop._open_pipe():
            for sig in SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    stop._previous[sig] = signal.signal(sig, _noted)
            stop._thread = threading.Thread(target=stop._watch, name="orlhf-stop", daemon=True)
            stop._thread.start()
        outer, cls.active = cls.active, (stop if stop._thread is not None else cls.active)
        try:
            yield stop
        finally:
            cls.active = outer
            if stop.at_once:  # the stop thread is ending the process: never race it to the exit
                stop._gone.wait()
            if not until_exit:
                stop._close()

    @classmethod
    @contextmanager
    def for_run(cls, grace_s: Optional[float] = None, until_exit: bool = False) -> Iterator["RunStop"]:
        """The RunStop installed in this process already (the command's, before its imports: orlhf/entry.py), given
        the run's --stop_grace_s when known; else one installed here (`until_exit`: installed())."""
        if cls.active is not None:
            if grace_s is not None:
                cls.active.grace_s = grace_s
            yield cls.active
            return
        with cls.installed(GRACE_S if grace_s is None else grace_s, until_exit=until_exit) as stop:
            yield stop

    def take_back(self) -> None:
        """Handle SIGINT and SIGTERM here again should a library have replaced the handlers."""
        for sig in self._previous:
            if signal.getsignal(sig) is not _noted:
                signal.signal(sig, _noted)

    def follow(self, attempt) -> None:
        """`attempt` starts (the first, or the next after a restart)."""
        self.attempt, self.phase = attempt, None

    # ---- the stop thread --------------------------------------------------------------------------------------
    def _watch(self) -> None:
        r = self._pipe[0]
        while True:
            due = [t for t in (self._grace_end, self._final_end) if t is not None]
            ready, _, _ = select.select([r], [], [], max(0.0, min(due) - time.monotonic()) if due else None)
            if not ready:
                self.deadline_passed(time.monotonic())
                continue
            try:
                data = os.read(r, 256)
            except BlockingIOError:
                continue
            for byte in data:
                if byte == _QUIT[0]:
                    return
                if byte in SIGNALS:
                    self.arrived(signal.Signals(byte))

    def arrived(self, sig: signal.Signals) -> None:
        """One arrival of `sig` (the stop thread calls it; tests may too)."""
        name = sig.name
        if self._ended.is_set():  # the line is written, the process on its way out: make it go now
            self.stop_now()
            return
        if self.signal is None and self._ending():  # the run is complete, its teardown under way
            log.warning("%s: the run is ending; its processes are being shut down", name)
            self._late = self._late or name
            self._final_end = time.monotonic() + END_S
            return
        where = self.describe()
        if self.signal is not None:  # a second one
            self.where, self.forced = where, True
            self.stop_now()
            return
        self.signal, self.where = name, where
        if not self._finishes_first() or self.grace_s <= 0:
            self.stop_now()
            return
        controller = self.attempt.controller
        controller.stop_signal = name  # Controller.should_stop: the loop ends at the step boundary
        again = "Ctrl-C" if sig == signal.SIGINT else name
        bound = f"if that takes at most {self.grace_s:g} s (--stop_grace_s)"
        if self.attempt.phase == "export" or controller.saving:
            log.warning("%s %s: stopping once it is written, %s; %s again stops at once, without it", name, where,
                        bound, again)  # fmt: skip
        else:
            log.warning("%s %s: stopping after it, with a checkpoint there, %s; %s again stops at once, without one",
                        name, where, bound, again)  # fmt: skip
        now = time.monotonic()
        self._grace_end, self._final_end = now + self.grace_s, now + self.grace_s + END_S

    def deadline_passed(self, now: float) -> None:
        """The grace for what a first signal let finish is over while it still runs: stop now, naming the bound; or
        the teardown after it has outlasted END_S: stop now."""
        if self._grace_end is not None and now >= self._grace_end:
            self._grace_end = None
            if self._finishes_first():
                self._reason = f" (it did not end within --stop_grace_s {self.grace_s:g} s)"
                self.where = self.describe()
                self.stop_now()
        if self._final_end is not None and now >= self._final_end:
            if self.signal is None:  # a signal during a complete run's teardown, which outlasted END_S
                self.signal, self.where = self._late or "SIGTERM", "at the end of the run"
            self.stop_now()

    def _finishes_first(self) -> bool:
        """Whether the phase in progress may end before the stop: a step, its checkpoint, the export."""
        return self.phase is None and self.attempt is not None and self.attempt.phase in ("training", "export")

    def _ending(self) -> bool:
        return self.attempt is not None and self.attempt.phase == "done" and self.phase is None

    def describe(self) -> str:
        """Where the run is, in words: "during the start-up", "during step 7", "during the restart ...", ..."""
        attempt = self.attempt
        if self.phase == RESTART or (attempt is not None and attempt.number and attempt.phase == "start-up"):
            return "during the restart after a lost process"
        return attempt.where() if attempt is not None else "during the start-up"

    def stop_now(self) -> None:
        """End the run from this thread: its processes, then its line, then the process (module docstring). Once
        the main thread has written the line, only the processes and the exit are left to do."""
        with self._end_lock:
            written = self._ended.is_set()
            self._ended.set()
            self.at_once = True
            self._grace_end = self._final_end = None
            code = self._code if written and self._code is not None else self._stop_code()
            # The exit is certain whatever happens below (a log handler's lock held forever by a stuck thread).
            timer = threading.Timer(KILL_S + 5.0, self._exit, (code,))
            timer.daemon = True
            timer.start()
            from orlhf.storage.logs import mute_terminal

            mute_terminal()  # the main thread's failing calls: driver.log only
            say = self._kill(KILL_S)
            if not logging.getLogger().handlers and not log.handlers:  # before the run set up its logging
                logging.basicConfig(level=logging.INFO, format="[orlhf] %(message)s")
            if not written:
                code = self._line(say=say)
        _flush_logs()
        self._code = code
        self._exit(code)
        self._gone.set()  # (reached only where `exit` returns: tests)

    # ---- the end (its line: launch/stop_line.py) -------------------------------------------------------------------
    def outcome(self, code: Optional[int]) -> Optional[int]:
        """The main thread's end of the run, after its teardown: when a signal stopped the run, its one line (where,
        what is kept, how to continue) and 128 + the signal's number; `code` otherwise, also when a signal let the
        export finish (the line says so). Once the stop thread ends the run, it waits for that."""
        with self._end_lock:
            if not self.at_once:
                self._ended.set()
                self._code = self._line(code)
                return self._code
        self._gone.wait()  # the stop thread exits the process (returns only where `exit` returns: tests)
        return self._code

    # ---- the wakeup pipe ----------------------------------------------------------------------------------------
    def _open_pipe(self) -> bool:
        """The wakeup pipe the stop thread reads; False where one is set already (an event loop's): then nothing is
        installed and the signals keep their handlers."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old != -1:
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return False
        self._pipe = (r, w)
        return True

    def _close(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        if self._pipe is None:
            return
        signal.set_wakeup_fd(-1)
        os.write(self._pipe[1], _QUIT)
        self._thread.join(timeout=5.0)
        for fd in self._pipe:
            os.close(fd)
        self._pipe = None


def _noted(signum: int, frame) -> None:
    """The Python-level handler: nothing. Its presence makes CPython's C handler write the arrival into the wakeup
    pipe, and replaces the default actions (KeyboardInterrupt, termination)."""


def _preload() -> None:
    import psutil  # noqa: F401
    import tqdm  # noqa: F401

    import orlhf.distributed.processes  # noqa: F401
    import orlhf.storage.checkpoint  # noqa: F401
    import orlhf.storage.logs  # noqa: F401


def _kill_run_processes(wait_s: float) -> Optional[Callable[[str], Any]]:
    """Every process of the run ended (distributed/processes.py), with this process's output (descriptors 1 and 2,
    Ray's C++ lines as its processes go included) in driver.log from now on; returns what writes the last line to
    the terminal that descriptor 2 was."""
    from orlhf.distributed.processes import end_descendants
    from orlhf.distributed.ray_start import RAY_HEAD_PROCESSES
    from orlhf.storage.logs import worker_log_path

    terminal = os.dup(2)
    try:
        aside = os.open(worker_log_path("driver") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(aside, 1)
        os.dup2(aside, 2)
        os.close(aside)
    except OSError:
        pass
    _SPARED[:] = end_descendants(wait_s, spare=RAY_HEAD_PROCESSES)
    return lambda text: os.write(terminal, (text + "\n").encode())


# The local cluster's GCS and raylet outlive the rest of the run by the time its line takes: a Ray call of the main
# thread (a restart's wait for its nodes) whose GCS goes away fails a check in Ray's C++ and aborts the driver
# (SIGABRT, no line). They are killed outright just before this process exits (_exit_process).
_SPARED: list = []


def _exit_process(code: int) -> None:
    for p in _SPARED:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - gone already
            pass
    os._exit(code)


def exit_keeping_handlers(code: int) -> None:
    """The command's exit (orlhf/entry.py) with its SIGINT/SIGTERM handling still in place to the end: other threads
    joined and the exit functions run (Ray's, wandb's) as Python's exit does them, the output flushed, then
    os._exit. Python's own exit puts the default actions back early in its teardown (before it frees its modules,
    which takes a while with torch loaded): a signal then would end the process by that signal (rc -15) instead of
    with the run's code."""
    import atexit

    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    _flush_logs()
    logging.shutdown()
    _exit_process(code)


def _flush_logs() -> None:
    import sys

    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
