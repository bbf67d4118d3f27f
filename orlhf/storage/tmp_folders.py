"""Temporary folders a writer fills before one rename publishes them (checkpoints, final exports), and the
cleanup of those a killed writer left behind.

    writer:   mkdir tmp -> write_owner(tmp) (owner.json: pid, host, run id) -> fill -> fsync_tree(tmp)
              -> rename into place -> fsync_dir(parent)
    cleanup:  remove_stale(candidates) removes each whose writer is gone (runlock.owner_gone), keeps the others
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Iterable

from orlhf.storage.runlock import OWNER_NAME, owner_gone

log = logging.getLogger(__name__)


def remove_stale(tmp: Iterable[Path], what: str, trash: Iterable[Path] = ()) -> list[Path]:
    """Remove the folders in `tmp` whose writer is gone, and every folder in `trash` (a folder being deleted:
    nobody writes it); keep, with a warning, a tmp folder whose writer still runs. Call only while this process
    writes none of them (its own folders count as gone). `what` names them in the log ("an unfinished export").
    Returns the removed folders: trash first, then tmp, each in the order given."""
    tmp = [p for p in tmp if p.is_dir()]
    stale = [p for p in trash if p.is_dir()] + [p for p in tmp if owner_gone(p)]
    for path in tmp:
        if path not in stale:
            log.warning("keeping %s: its writer (%s) is still running", path, path / OWNER_NAME)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the leftover of %s: %s", what, path)
    return stale


def fsync_tree(root: Path) -> None:
    """Make every file under `root` and every folder's entries durable (before the rename that publishes it)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, a rename) durable. Some network filesystems refuse fsync on a
    directory (EINVAL); there the rename is as durable as that filesystem makes it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
