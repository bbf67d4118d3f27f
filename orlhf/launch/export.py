"""The final exports, atomic: <save_path>/actor (and, with --save_value_network, <save_path>/critic) is either the
previous model or the new one, whole, never a mix or a half-written folder.

    tmp = <save_path>/.tmp-actor-<hex> (owner.json: pid, host, run id) -> actor ranks: save_hf(tmp) (collective)
    -> drop owner.json -> fsync every file and folder -> swap tmp and actor (renameat2 RENAME_EXCHANGE: one
    atomic step) -> delete the old model (now at tmp)

transformers' save_pretrained deletes the old shards before writing the new ones, so exporting in place loses
the model on a kill or a full disk mid-write. Leftover `.tmp-actor-*` folders of dead runs are removed at the
next export (only those whose owner is gone: runlock.owner_gone).

A failed export (a full disk: NoSpaceError) leaves the trained weights only in the ranks' memory, so the run keeps
them before it stops (export_failed): a checkpoint of the last step, from which `--load_checkpoint` exports again
without training; when that cannot be written either, the HF actor in the system's temp folder if it is on another
disk (rescue_actor); the one-line ExportError says where they are, or that nothing could be written.
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

from orlhf.storage.checkpoint_format import step_dir_name
from orlhf.storage.disk_space import NoSpaceError, cleanup_after_failed_write
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
    into `out`, atomically, as the actor's export. Returns `out`. A failed export removes its temp folder (the
    previous model at `out` stays) and raises; a full disk as NoSpaceError, measured before that removal."""
    out, tmp = Path(out).expanduser().absolute(), None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_exports(out)
        tmp = out.parent / f"{_TMP}{out.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        write_owner(tmp, run_id)
        group.call(save, str(tmp)).get()
        publish(tmp, out)
    except Exception as e:
        cleanup_after_failed_write(e, out.parent, tmp)  # (tmp lives there: the same filesystem)
    return out


class ExportError(RuntimeError):
    """The final export failed; the one-line message says where the trained weights are kept, or that nothing
    could keep them, and how to export again."""


def export_failed(error: Exception, out: Path, controller) -> ExportError:
    """The error for an export to `out` that raised `error`, after keeping the trained weights: a checkpoint of the
    last step (the one already saved, else one saved now into --ckpt_path), from which a run with
    --load_checkpoint and nothing left to train only exports."""
    from orlhf.trainer.run_state import foreign_checkpoint, save_run

    why = str(error) if isinstance(error, NoSpaceError) else f"{type(error).__name__}: {first_line(error)}"
    step, mgr = controller.step_index, controller.checkpoints
    kept, not_kept = None, "no --ckpt_path"
    if mgr is not None:
        newest, other = mgr.latest(), foreign_checkpoint(mgr)
        if newest is not None and newest.name == step_dir_name(step) and newest != other:
            kept = newest  # saved at this step already (--save_steps, the stop)
        elif other is not None:  # saving among them would mix two runs' checkpoints
            not_kept = f"{mgr.root} holds another run's checkpoints"
        else:
            try:
                kept = save_run(controller.run_state(), mgr)
            except Exception as e:  # noqa: BLE001 - reported in the line below
                not_kept = str(e) if isinstance(e, NoSpaceError) else f"{type(e).__name__}: {first_line(e)}"
    fix = f"free space on {out.parent}" if isinstance(error, NoSpaceError) else "fix that"
    rescued = rescue_actor(controller, out, mgr) if kept is None and isinstance(error, NoSpaceError) else None
    if rescued is not None:
        return ExportError(
            f"could not export to {out}: {why}; nor save a checkpoint instead ({not_kept}). The trained actor of step "
            f"{step} is kept as an HF folder on another disk, {rescued}: it is the export (transformers and vLLM load "
            f"it); {fix} and move it there."
        )
    if kept is not None and controller.cfg.logging.disable_ds_ckpt:  # no training state: the HF folder is the model
        return ExportError(
            f"could not export to {out}: {why}. The trained actor of step {step} is kept as an HF folder in "
            f"{kept / 'hf' / 'actor'}: {fix} and copy it (or choose another --save_path next time)."
        )
    if kept is not None:
        return ExportError(
            f"could not export to {out}: {why}. The trained weights of step {step} are kept in the checkpoint "
            f"{kept}: {fix} (or choose another --save_path) and run the same command with "
            f"--load_checkpoint --ckpt_path {mgr.root}, which has no step left to train and only exports."
        )
    return ExportError(
        f"could not export to {out}: {why}; nor save a checkpoint instead ({not_kept}). Nothing kept the trained "
        f"weights: {fix} (or choose another --save_path and --ckpt_path) and train again; --save_steps keeps "
        "checkpoints along the way."
    )


def rescue_actor(controller, out: Path, mgr) -> Path | None:
    """The HF actor (the export itself) written into the system's temp folder when that is another filesystem than
    the run's full ones (<tmp>/orlhf-<run id>-step_N/actor), the last place left to keep the trained weights; None when
    it shares their filesystem or the write fails too."""
    import tempfile

    from orlhf.storage.disk_space import same_filesystem

    run_id = getattr(mgr, "run_id", "") or "run"
    rescue = Path(tempfile.gettempdir()) / f"orlhf-{run_id}-{step_dir_name(controller.step_index)}"
    full = [out.parent] + ([mgr.root] if mgr is not None else [])
    if any(same_filesystem(rescue, folder) for folder in full):
        return None
    try:
        return export_actor(controller.m.actor, rescue / "actor", run_id)
    except Exception as e:  # noqa: BLE001 - the caller's line says nothing was kept
        log.warning("could not keep the trained actor in %s either: %s", rescue, first_line(e))
        return None


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


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
