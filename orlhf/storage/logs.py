"""What reaches the terminal during `orlhf train-ppo`, and where everything else goes.

    terminal (stderr)                   orlhf's own lines ("[orlhf] ..."), the progress bar, each warning once
                                        (repeats counted and reported at the end), errors whole
    <save_path>/logs/driver.log         every library's log records and Python warnings in the driver process
    <save_path>/logs/<role>-<rank>.log  a model rank's stdout and stderr (DeepSpeed, torch, gloo, C++ prints)
    <save_path>/logs/vllm-<index>.log   a vLLM engine's (its engine-core processes inherit the file)
    <save_path>/logs/reward_func.log    what a --remote_rm_url .py file's reward_func prints (the terminal gets one
                                        line per call that printed: how many lines, and this file)

The driver sets ORLHF_LOG_DIR; each rank and engine actor calls redirect_output() first thing, which points its
file descriptors 1 and 2 at its log file, so Ray has nothing to forward and the bar is never torn. --verbose turns
all of this off: libraries log to the terminal and Ray forwards every worker's output, as before.
A rank's error still reaches the terminal: its traceback travels with the exception (distributed.groups.RankError),
and a rank that died without one is reported with the end of its log file.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from orlhf.storage.run_folder import RunFolder

LOG_DIR_ENV = "ORLHF_LOG_DIR"
TERMINAL_FORMAT = "[orlhf] %(message)s"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


EVERY_TIME = {"every_time": True}  # `extra` of a warning that is news each time (a restart's wait for a node)


class OncePerMessage(logging.Filter):
    """Lets a warning through the first time; counts the repeats (reported by RunLogs.close). A record logged with
    extra=EVERY_TIME always passes: a user watching a run must see each wait it starts, not the first only."""

    def __init__(self):
        super().__init__()
        self.repeats: Counter[str] = Counter()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.levelno >= logging.ERROR or getattr(record, "every_time", False):
            return True
        key = record.getMessage()
        if key in self._seen:
            self.repeats[key] += 1
            return False
        self._seen.add(key)
        return True


class BarSafeHandler(logging.Handler):
    """Writes above a live tqdm bar (tqdm.write) so the bar is redrawn whole below the line. Without a fixed
    stream it writes to whatever sys.stderr is at the time (so a test's captured stderr never goes stale)."""

    only_thread: Optional[int] = None  # set once a stop signal ends the run: that thread's records only (-1: none)

    def __init__(self, stream=None):
        super().__init__()
        self.fixed = stream

    def emit(self, record: logging.LogRecord) -> None:
        if self.only_thread is not None and record.thread != self.only_thread:
            return  # (driver.log still has it)
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.fixed or sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


# Each phase of the run as it begins ("step 3: train"), for driver.log only: where a stuck or stopped run was.
# It never propagates to orlhf's terminal handler, not even before setup_driver gives it driver.log (the start-up
# clock's first mark comes before the run's logs exist).
TRACE = "orlhf.trace"
logging.getLogger(TRACE).propagate = False
logging.getLogger(TRACE).addHandler(logging.NullHandler())


def mute_terminal() -> None:
    """From now on no record and no progress bar reaches the terminal (driver.log still has every record): a
    signal's stop ends the run from its own thread (launch/stop_signals.py), which writes the last line itself,
    while the main thread's calls fail one by one."""
    BarSafeHandler.only_thread = -1
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()  # the bar as it was, left above the line that follows
    except Exception:  # noqa: BLE001 - a bar is not worth a stop
        pass


def terminal_muted() -> bool:
    """Whether mute_terminal was called (a progress bar made now stays hidden)."""
    return BarSafeHandler.only_thread is not None


class RunFileHandler(logging.FileHandler):
    """driver.log; a type of its own so a second run in one process replaces it."""


class RunLogs:
    """The driver's logging for one run; close() reports repeated warnings and restores nothing (process ends)."""

    def __init__(self, log_dir: Optional[Path], once: OncePerMessage, verbose: bool):
        self.log_dir, self.once, self.verbose = log_dir, once, verbose

    def summary(self) -> str:
        if self.verbose or self.log_dir is None:
            return "logs: all output on this terminal (--verbose)"
        return (
            f"logs: {self.log_dir}/ (driver.log; <role>-<rank>.log per model rank; vllm-<i>.log per engine; "
            "reward_func.log; --verbose shows them here)"
        )

    def route_transformers(self) -> None:
        """Send transformers' records to driver.log, as setup_driver does for the libraries already imported. The
        driver calls it where it first imports transformers (launch/run.py: the inputs thread, the value-head check):
        importing transformers only to route its logger would cost CPU time on the main thread before Ray's start."""
        if not self.verbose:
            _route_transformers_logging()

    def close(self) -> None:
        log = logging.getLogger("orlhf")
        for message, n in self.once.repeats.most_common():
            log.info("warning repeated %d more time(s): %s", n, message.splitlines()[0][:160])


def setup_driver(save_path: str, verbose: bool = False, stream=None) -> RunLogs:
    """Route this process's logging (see the module docstring). Call once, before Ray starts."""
    once = OncePerMessage()
    BarSafeHandler.only_thread = None  # (an earlier run in this process that a signal ended)
    terminal = BarSafeHandler(stream)
    terminal.setFormatter(logging.Formatter(TERMINAL_FORMAT))
    terminal.addFilter(once)
    root, ours = logging.getLogger(), logging.getLogger("orlhf")
    for logger in (root, ours):  # a previous run in this process (tests) leaves its handlers: replace them
        for h in list(logger.handlers):
            if isinstance(h, (BarSafeHandler, RunFileHandler)) or (logger is root and not verbose and _to_terminal(h)):
                logger.removeHandler(h)
                h.close()
    root.setLevel(logging.INFO)
    ours.setLevel(logging.INFO)
    # warnings.warn -> the "py.warnings" logger -> driver.log. Off then on: an earlier run in this process may have
    # turned capture on inside a warnings.catch_warnings() that has since restored showwarning, and a plain
    # captureWarnings(True) is then a no-op that leaves warnings on the terminal.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    if verbose:
        os.environ.pop(LOG_DIR_ENV, None)
        root.addHandler(terminal)
        return RunLogs(None, once, verbose=True)
    log_dir = RunFolder.at(save_path).logs
    log_dir.mkdir(parents=True, exist_ok=True)
    to_file = RunFileHandler(log_dir / "driver.log")
    to_file.setFormatter(logging.Formatter(FILE_FORMAT))
    root.addHandler(to_file)
    trace = logging.getLogger(TRACE)
    for h in list(trace.handlers):
        trace.removeHandler(h)
    trace.propagate, trace.level = False, logging.INFO
    trace.addHandler(to_file)
    ours.addHandler(terminal)  # orlhf's records also propagate to driver.log
    os.environ[LOG_DIR_ENV] = str(log_dir.resolve())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # Hugging Face's own bars (e.g. shard writing)
    if "transformers" in sys.modules:  # else RunLogs.route_transformers, where the driver imports it
        _route_transformers_logging()
    for name in LIBRARY_LOGGERS:
        _route_to_root(logging.getLogger(name))
    return RunLogs(log_dir, once, verbose=False)


# Libraries that give their logger a terminal handler of its own (Ray does at import, e.g. for its
# token-authentication notice) instead of propagating to the root logger.
LIBRARY_LOGGERS = ("ray", "deepspeed", "DeepSpeed", "vllm", "torch", "datasets", "urllib3")


def _route_to_root(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            logger.removeHandler(h)
    logger.propagate = True


def _route_transformers_logging() -> None:
    """transformers logs through its own terminal handler and does not propagate: send its records to the root
    logger (driver.log) instead. Importing transformers.utils.logging imports transformers itself."""
    try:
        import transformers.utils.logging as hf_logging
    except ImportError:
        return
    hf_logging.get_logger()  # creates its default handler now, so it is not re-added after this
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def _to_terminal(h: logging.Handler) -> bool:
    return type(h) is logging.StreamHandler and getattr(h, "stream", None) in (
        sys.stderr,
        sys.stdout,
        sys.__stderr__,
        sys.__stdout__,
    )


def worker_log_path(name: str) -> Optional[Path]:
    """Where the process called `name` ("actor-0", "vllm-1"), or the user code called `name` ("reward_func"),
    writes; None when output is not redirected (--verbose)."""
    d = os.environ.get(LOG_DIR_ENV)
    return Path(d) / f"{name}.log" if d else None


def redirect_output(name: str) -> None:
    """In a rank or engine actor: send fds 1 and 2 (Python and C++ output alike) to its log file. Best effort: an
    unwritable folder (another node without the shared path) leaves Ray's own worker logs in place."""
    path = worker_log_path(name)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if not logging.getLogger().handlers:  # orlhf's own records in this process ("actor rank 0/2 ready ...")
        logging.basicConfig(level=logging.INFO, format=FILE_FORMAT, stream=sys.stderr)


def tail(path: Optional[Path], lines: int = 30) -> str:
    """The last `lines` lines of a log file ("" if there is none): what a rank printed before it died."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])
