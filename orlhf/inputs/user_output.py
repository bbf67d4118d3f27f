"""What user code prints while orlhf calls it (a reward_func), sent to a log file instead of the terminal.

    with captured_output(path) as printed:    in the thread that runs the user's function
        func(...)                             its sys.stdout / sys.stderr writes -> path (appended)
    printed.lines                             how many lines it wrote (the caller says so in one terminal line)

While any capture is active, sys.stdout and sys.stderr are ThreadRouter stand-ins that send each write by the
thread making it: a capturing thread's to its file, every other thread's (orlhf's log lines, the progress bar) to
the stream they replaced. The last capture to end puts the original streams back (unless something replaced them
meanwhile). Only Python-level writes are routed: what a C extension or a subprocess writes to file descriptors 1
and 2 directly, or what threads the user's function starts print, still reaches the terminal.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, TextIO

_lock = threading.Lock()
_sinks: dict[int, "Printed"] = {}  # thread ident -> where that thread's writes go


class Printed:
    """One capture's file and line count. The file is opened at the first write (a silent call creates nothing)."""

    def __init__(self, path: Optional[str | os.PathLike]):
        self.path = Path(path) if path is not None else None
        self._newlines = 0
        self._partial = False  # the last write did not end its line
        self._file: Optional[TextIO] = None
        self._failed = False

    @property
    def lines(self) -> int:
        """Lines written so far (an unfinished last line counts)."""
        return self._newlines + self._partial

    def write(self, text: str, fallback: TextIO) -> int:
        if not text:
            return 0
        self._newlines += text.count("\n")
        self._partial = not text.endswith("\n")
        if self._file is None and not self._failed:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8", errors="replace")
            except OSError:
                self._failed = True  # an unwritable log folder: the output stays on the terminal
        if self._file is None:
            return fallback.write(text)
        return self._file.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            if self._partial:  # the next capture starts a line of its own
                self._file.write("\n")
            self._file.close()
            self._file = None


class ThreadRouter:
    """Stands in for sys.stdout or sys.stderr: a capturing thread's writes go to its Printed, the others' to
    `inner` (the stream it replaced). Everything else (encoding, isatty, fileno) is the inner stream's."""

    def __init__(self, inner: TextIO):
        self.inner = inner

    def write(self, text: str) -> int:
        sink = _sinks.get(threading.get_ident())
        if sink is None:
            return self.inner.write(text)
        return sink.write(text, self.inner)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        sink = _sinks.get(threading.get_ident())
        if sink is None:
            self.inner.flush()
        else:
            sink.flush()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextmanager
def captured_output(path: Optional[str | os.PathLike]) -> Iterator[Printed]:
    """Route this thread's sys.stdout / sys.stderr writes to `path` (appended) until the block ends; yields the
    Printed that counts them. `path` None: nothing is routed (the output stays where it was), lines stays 0."""
    printed = Printed(path)
    if path is None:
        yield printed
        return
    ident = threading.get_ident()
    with _lock:
        if not _sinks:
            _install()
        _sinks[ident] = printed
    try:
        yield printed
    finally:
        with _lock:
            _sinks.pop(ident, None)
            if not _sinks:
                _uninstall()
        printed.close()


def _install() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, ThreadRouter):
            setattr(sys, name, ThreadRouter(stream))


def _uninstall() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, ThreadRouter):  # else something replaced it meanwhile: leave that in place
            setattr(sys, name, stream.inner)
