"""One run per folder: an exclusive lock on the run folder (--save_path) and the checkpoint folder, held for the
whole run, and owner records for temporary folders.

    start:  hold_folders(cfg, run_id) -> <save_path>/.orlhf.lock and <ckpt>/.orlhf.lock, flock(LOCK_EX | LOCK_NB)
            taken -> RunLockError naming the holder (pid, host, run id, start time): the second run exits at once
    temp:   write_owner(tmp, run_id) right after creating a temporary folder; owner_gone(tmp) says whether its
            writer is dead, so cleanup removes only what nobody is still writing

Invariants:
- The kernel drops an flock when its holder dies (kill -9 included), so a crashed run never blocks the next.
- The lock file is never deleted (deleting it would let two runs lock two different files of one name).
- flock is per open file: a second lock of the same folder from this same process is refused too.
- On a shared filesystem (NFS v4, Lustre, ...) flock covers all nodes when the filesystem supports it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Optional

log = logging.getLogger(__name__)

LOCK_NAME = ".orlhf.lock"
OWNER_NAME = "owner.json"


class RunLockError(RuntimeError):
    """Another live run holds the folder; the message names it and the fix."""


class FolderLock:
    """An exclusive, non-blocking lock on `folder` for as long as this object is held (a context manager)."""

    def __init__(self, folder: str | os.PathLike, run_id: str, flag: str):
        self.folder, self.run_id, self.flag = Path(folder).expanduser().absolute(), run_id, flag
        self._fd: Optional[int] = None

    def __enter__(self) -> "FolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_record(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockError(
                f"{self.flag} {self.folder} is in use by another orlhf run ({_describe(holder)}); two runs in one "
                f"folder destroy each other's checkpoints and metrics. Wait for that run to end (or stop it: "
                f"kill {holder.get('pid', '<pid>')}), or pass another {self.flag}."
            ) from None
        record = _owner_record(self.run_id)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


@contextmanager
def hold_folders(save_path: str, ckpt_path: str, run_id: str) -> Iterator[None]:
    """Lock the run folder and the checkpoint folder (once if they are the same folder)."""
    with ExitStack() as stack:
        stack.enter_context(FolderLock(save_path, run_id, "--save_path"))
        if Path(ckpt_path).expanduser().absolute() != Path(save_path).expanduser().absolute():
            stack.enter_context(FolderLock(ckpt_path, run_id, "--ckpt_path"))
        yield


# ---- owners of temporary folders ------------------------------------------------------------------------------


def write_owner(folder: str | os.PathLike, run_id: str) -> None:
    """Record who writes `folder` (pid, host, run id), so a later cleanup can tell a live save from a dead one."""
    (Path(folder) / OWNER_NAME).write_text(json.dumps(_owner_record(run_id)))


def owner_gone(folder: str | os.PathLike) -> bool:
    """True when the process that wrote `folder`'s owner record is no longer running (or never wrote one: a
    writer records itself right after mkdir, so only a writer killed in between leaves none). A record from
    another host counts as alive: its pid cannot be checked from here. This process's own folders count as gone:
    cleanup runs before this process's first save."""
    try:
        rec = json.loads((Path(folder) / OWNER_NAME).read_text())
        pid, host = int(rec["pid"]), str(rec["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return True
    if host != socket.gethostname():
        return False
    return pid == os.getpid() or not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _owner_record(run_id: str) -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "run_id": run_id,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _read_record(fd: int) -> dict:
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(rec: dict) -> str:
    if not rec:
        return "holder unknown"
    return (
        f"pid {rec.get('pid', '?')} on {rec.get('host', '?')}, run id {rec.get('run_id', '?')}, "
        f"since {rec.get('since', '?')}"
    )
