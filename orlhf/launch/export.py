"""The final exports, atomic: <save_path>/actor (and, with --save_value_network, <save_path>/critic) is either the
previous model or the new one, whole, never a mix or a half-written folder.

    tmp = <save_path>/.tmp-actor-<hex> (owner.json: pid, host, run id) -> actor ranks: save_hf(tmp) (collective)
    -> drop owner.json -> fsync every file and folder -> swap tmp and actor (renameat2 RENAME_EXCHANGE: one
    atomic step) -> delete the old model (now at tmp)

transformers' save_pretrained deletes the old shards before writing the new ones, so exporting in place loses
the model on a kill or a full disk mid-write. Leftover `.tmp-actor-*` folders of dead runs are removed at the
next export (only those whose owner is gone: runlock.owner_gone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from orlhf.storage.runlock import OWNER_NAME, write_owner
from orlhf.storage.tmp_folders import fsync_dir, fsync_tree, remove_stale
from orlhf.workers.policy import PolicyWorker

log = logging.getLogger(__name__)
_TMP = ".tmp-"
_RENAME_EXCHANGE = 2  # linux/fs.h


def export_actor(actor_group, out: str | os.PathLike, run_id: str = "") -> Path:
    """The actor group's HF folder into `out`, atomically (see the module docstring). Returns `out`."""
    return export_model(actor_group, PolicyWorker.save_hf, out, run_id)


def export_model(group, save, out: str | os.PathLike, run_id: str = "") -> Path:
    """`group.call(save, folder)` (a collective writing one model folder, e.g. CriticWorker.save_value_network)
    into `out`, atomically, as the actor's export. Returns `out`."""
    out = Path(out).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(out)
    tmp = out.parent / f"{_TMP}{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    write_owner(tmp, run_id)
    group.call(save, str(tmp)).get()
    publish(tmp, out)
    return out


def publish(tmp: Path, out: Path) -> None:
    """Make the finished folder `tmp` the folder `out` (replacing one that is there) durably and atomically."""
    (tmp / OWNER_NAME).unlink(missing_ok=True)
    fsync_tree(tmp)
    if out.exists():
        if not _exchange(tmp, out):  # a filesystem without RENAME_EXCHANGE: two renames, a short window
            old = out.parent / f"{_TMP}{out.name}-old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            tmp = old
        fsync_dir(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous model
    else:
        os.rename(tmp, out)
        fsync_dir(out.parent)


def remove_stale_exports(out: Path) -> list[Path]:
    """`.tmp-<name>-*` folders next to `out` whose writer is gone (a killed export). Returns what was removed."""
    return remove_stale(out.parent.glob(f"{_TMP}{out.name}-*"), "an unfinished export")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2). False where the system or filesystem cannot."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name, use_errno=True) if name else None
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))
