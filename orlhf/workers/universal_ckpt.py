"""A trained role's DeepSpeed checkpoint loaded on another rank count (--use_ds_universal_ckpt): converted once to
DeepSpeed's universal format, then loaded with the engine's `checkpoint.load_universal` setting on. When that applies
is storage/ds_layout.py's load_plan; workers/checkpoint_io.py calls this.

    <checkpoint>/<role>/<tag>/                      every rank's ZeRO partitions, as N ranks saved them
        rank 0: DeepSpeed's ds_to_universal, called in this process -->
    <checkpoint>/.tmp-<role>_universal-<id>/<tag>/  then one rename to
    <checkpoint>/<role>_universal/                  latest_universal (the tag), <tag>/zero/<param>/{fp32,exp_avg,
                                                    exp_avg_sq}.pt: each parameter whole, for any rank count
    every rank: engine.load_checkpoint(<role>_universal, tag), load_universal on for that call only

Invariants
- The universal folder appears whole or not at all: written into a temporary folder beside it, fsynced, renamed. A
  temporary folder a crash left is removed before the next conversion; a universal folder already there is reused
  (later resumes from the same checkpoint, on any rank count). Rotation deletes it with its checkpoint.
- Only rank 0 writes; the others wait for its outcome (a broadcast), so a failed conversion raises on every rank.
- Nothing is unpickled: DeepSpeed's conversion and its universal load call torch.load(weights_only=False) directly,
  so while they run torch.load is storage.checkpoint_state.safe_torch_load (weights-only, DeepSpeed's plain state
  classes allowed). The rank's process does nothing else meanwhile (a load runs right after init, before any other
  call).
- DeepSpeed 0.19.8 reads load_universal only inside load_checkpoint (engine.load_universal_checkpoint()), so setting
  it for that call is OpenRLHF's `"checkpoint": {"load_universal": true}` without making a later load universal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from orlhf.storage.checkpoint_format import TMP_PREFIX, CheckpointError
from orlhf.storage.ds_layout import UNIVERSAL_SUFFIX
from orlhf.storage.tmp_folders import fsync_dir, fsync_tree

log = logging.getLogger(__name__)


def universal_folder(folder: str | os.PathLike, tag: str, rank: int, world_size: int) -> Path:
    """Collective: <checkpoint>/<role>_universal holding `folder`'s (<checkpoint>/<role>) tag `tag` in DeepSpeed's
    universal format, converted by rank 0 unless already there."""
    folder = Path(folder)
    out = folder.with_name(folder.name + UNIVERSAL_SUFFIX)
    error = None
    if rank == 0:
        try:
            if _holds(out, tag):
                log.info("%s: reusing the universal checkpoint %s", folder, out)
            else:
                _convert(folder, tag, out)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            log.exception("converting %s to DeepSpeed's universal format failed", folder)
            error = f"{folder}: converting it to DeepSpeed's universal format failed ({type(e).__name__}: {e})"
    if world_size > 1:
        import torch.distributed as dist

        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)
        error = outcome[0]
    if error:
        raise CheckpointError(error)
    return out


def load_universal(engine, folder: Path, tag: str, strict: bool):
    """engine.load_checkpoint of a universal folder: (path, client_state) as DeepSpeed returns them."""
    engine._config.load_universal_checkpoint = True
    try:
        with weights_only_loads():
            return engine.load_checkpoint(
                str(folder),
                tag=tag,
                load_module_strict=strict,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
    finally:
        engine._config.load_universal_checkpoint = False


def _holds(out: Path, tag: str) -> bool:
    """Whether `out` is a finished conversion of `tag` (it only appears by rename, so present means whole)."""
    if not out.exists():
        return False
    try:
        found = (out / "latest_universal").read_text().strip()
    except OSError:
        found = None
    if found != tag or not (out / tag).is_dir():
        raise CheckpointError(f"{out} does not hold a universal copy of {tag}: delete that folder and resume again")
    return True


def _convert(folder: Path, tag: str, out: Path) -> None:
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    for stale in out.parent.glob(f"{TMP_PREFIX}{out.name}-*"):  # a conversion that crashed (the run lock: not ours)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}-{uuid.uuid4().hex[:8]}"
    args = argparse.Namespace(
        input_folder=str(folder / tag),
        output_folder=str(tmp / tag),  # it writes latest_universal beside this, into tmp
        num_extract_workers=1,  # in this process: no worker processes, and the weights-only loads apply
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # ZeRO-1/2 conversion wants the parallelism patterns Megatron records; with no tensor or pipeline
        # parallelism DeepSpeed's default (none) is the whole answer
        inject_missing_state=True,
    )
    log.info("%s: converting to DeepSpeed's universal format in %s", folder, out)
    try:
        with weights_only_loads(), contextlib.redirect_stdout(io.StringIO()):  # its step-by-step prints
            ds_to_universal(args)
        fsync_tree(tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)


@contextlib.contextmanager
def weights_only_loads():
    """torch.load is checkpoint_state.safe_torch_load inside: DeepSpeed's weights_only=False is never granted."""
    from orlhf.storage.checkpoint_state import safe_torch_load

    real = torch.load

    def load(f, map_location=None, *_args, **_kwargs):
        return safe_torch_load(f, map_location=map_location, load=real)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real
