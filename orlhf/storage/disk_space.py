"""A write that failed because its filesystem is full, told apart from other failures and said in one line.

A full disk reaches the driver in several disguises: an OSError with errno ENOSPC (or EDQUOT, a quota) from a write
here; a rank's traceback as text (Ray passes remote errors on as strings: "OSError: [Errno 28] No space left on
device", safetensors' "StorageFull"); or torch's checkpoint writer, whose "[enforce fail at inline_container.cc]
... file write failed" carries no errno at all. So a failure counts as "no space" when

    an ENOSPC / EDQUOT OSError is in its chain (__cause__, __context__), or its text names one, or
    the filesystem it wrote to has (almost) nothing free left, measured right after the failure
    (before the partial folder is removed, which would free the space again)

    no_space_error(error, path) -> NoSpaceError (its message: "no space left on <path> (<free> free)") or None
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional

# Less than this free after a failed write: the write failed for lack of space (the writer's own chunk did not fit).
LOW_FREE_BYTES = 64 * 1024**2
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "storagefull", "[errno 28]", "[errno 122]")


class NoSpaceError(OSError):
    """A write failed because the filesystem holding `path` is full or over quota; str() is one line naming it."""

    def __init__(self, path: str | os.PathLike, free: Optional[int]):
        self.path, self.free = Path(path), free
        shown = f"{human_bytes(free)} free" if free is not None else "free space unknown"
        super().__init__(errno.ENOSPC, f"no space left on {self.path} ({shown})")

    def __str__(self) -> str:
        return self.strerror


def no_space_error(error: BaseException, path: str | os.PathLike) -> Optional[NoSpaceError]:
    """A NoSpaceError naming `path` (where the failed write went) if `error` is a full disk or quota (see the module
    docstring), else None. Call it before removing what the failed write left, so the free space is still the
    failure's."""
    free = free_bytes(path)
    if _says_full(error) or (free is not None and free < LOW_FREE_BYTES):
        return NoSpaceError(path, free)
    return None


def _says_full(error: BaseException) -> bool:
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(t in str(e).lower() for t in _FULL_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def free_bytes(path: str | os.PathLike) -> Optional[int]:
    """Bytes free to this user on the filesystem of `path` (or of its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def cleanup_after_failed_write(error: BaseException, path: str | os.PathLike, tmp) -> None:
    """After a write into `tmp` (a temp folder under `path`, or None) raised `error`: remove `tmp`, and raise a
    NoSpaceError from `error` when the disk was full (checked before the removal frees space), else `error`."""
    import shutil

    full = no_space_error(error, path)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if full is not None:
        raise full from error
    raise error
