"""Checkpoints on disk: atomic commit, rotation, resume lookup (the IO side of the folder).

The pure side (names, meta.json's format, the compatibility check, the state encoding) is storage/checkpoint_format.py;
what goes into the files (driver/rank state with RNG, DeepSpeed's files loaded safely) is storage/checkpoint_state.py.

    <ckpt_path>/
      step_000010/                 a complete checkpoint: it only ever appears by one os.rename, meta.json inside
        meta.json                  written last: format, step, time, orlhf version, run id, ranks per role, fingerprint,
                                   every file's size (a step folder whose file is missing or truncated is skipped)
        controller.json            driver state as plain JSON (step, loader, KL, reward norm, python/numpy RNG)
        controller.safetensors     its tensors (torch RNG states), referenced from controller.json
        actor/                     the actor group's DeepSpeed checkpoint (DeepSpeedWorker.save_checkpoint):
          latest, global_stepN/    every rank's ZeRO shards of parameters and optimizer, LR scheduler, counters
          rng_rank<r>.json|.safetensors   each rank's RNG states
          zero_to_fp32.py          DeepSpeed's offline consolidation script (python zero_to_fp32.py actor out)
        critic/                    the same for the critic (every trained role of config/roles.py has its folder)
        actor_universal/           added by a resume on another rank count (--use_ds_universal_ckpt): the actor's
                                   state in DeepSpeed's universal format (workers/universal_ckpt.py; not in "files")
        hf/actor/                  with --save_hf_ckpt: HF folder (safetensors) that transformers and vLLM load
                                   (--disable_ds_ckpt: only this and controller state; meta "resumable": false)
      .tmp-step_000020-1a2b3c4d/   a save in progress, or one that crashed: never read; owner.json inside names its
                                   writer (pid, host, run id): cleanup_stale_tmp removes it once that writer is gone
      .trash-step_000001-...       a rotated checkpoint being deleted

    start:  (runlock: this run holds <ckpt_path>/.orlhf.lock) mgr = CheckpointManager(--ckpt_path, --max_ckpt_num,
            run_id, --max_ckpt_mem); mgr.cleanup_stale_tmp()
            saving without --load_checkpoint: mgr.check_new_run() (another run's checkpoints are there: refuse)
    save:   tmp = mgr.begin(step) -> every trained group: save_checkpoint(tmp/<role>) (collective per group)
            -> driver: checkpoint_state.save_controller_state(tmp, state) -> mgr.commit(tmp, step, meta)
    resume: path = mgr.latest() (None: start fresh) -> checkpoint_format.check_compatible(read_meta(path),
            fingerprint.config_fingerprint(cfg)) -> ds_layout.check_resume(path, cfg) (ranks and ZeRO stages)
            -> every trained group, right after init: load_checkpoint(path/<role>)
            -> checkpoint_state.load_controller_state(path)

Invariants
- A `step_*` folder with a readable meta.json is complete: everything else is written and fsynced first, then
  meta.json (with every file's size), then one rename. A file deleted or truncated later (a full disk, a hand
  copy) makes the folder incomplete again: latest() says which file and falls back to the previous checkpoint.
  A crash at any point leaves either the previous checkpoints or a `.tmp-*`/`.trash-*` folder that latest() never
  returns. Deletion renames to `.trash-*` first, so a half-deleted checkpoint is
  never mistaken for a complete one.
- The manager deletes only folders named `step_<digits>` or `.tmp-step_*` / `.trash-step_*` in ckpt_path.
- --ckpt_path must be storage every node sees (one shared filesystem): ranks write, the driver renames.
- Loading never unpickles code: JSON, safetensors, and torch.load(weights_only=True) (DeepSpeed's own
  files: its two plain state classes are allow-listed for that load only, see checkpoint_state.safe_torch_load).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from orlhf.storage.checkpoint_format import (
    FORMAT_VERSION,
    META,
    STEP_DIR,
    TMP_PREFIX,
    TRASH_PREFIX,
    CheckpointError,
    files_problem,
    meta_problem,
    step_dir_name,
)
from orlhf.storage.run_folder import best_checkpoints
from orlhf.storage.runlock import OWNER_NAME, write_owner
from orlhf.storage.tmp_folders import fsync_dir, fsync_tree, remove_stale

log = logging.getLogger(__name__)

GIB = 1024**3  # --max_ckpt_mem's unit, as OpenRLHF's (max_mem * 1024**3 bytes)


# ---- the folder: begin, commit, rotate, latest ----------------------------------------------------------------


class CheckpointManager:
    """Owns <ckpt_path>: temporary folders, atomic commits, keeping the newest `max_ckpt_num` within a disk budget of
    `max_ckpt_mem` GiB (rotate), finding the latest.

    Driver-side only (one process). max_ckpt_num < 1 keeps every checkpoint; max_ckpt_mem None (or inf): no budget.
    """

    def __init__(
        self, ckpt_path: str | os.PathLike, max_ckpt_num: int, run_id: str = "", max_ckpt_mem: Optional[float] = None
    ):
        self.root = Path(ckpt_path).expanduser().absolute()
        self.max_ckpt_num = max_ckpt_num
        self.run_id = run_id  # recorded in every temp folder's owner.json and every meta.json
        self.max_ckpt_mem = max_ckpt_mem

    def best(self) -> "CheckpointManager":
        """The manager of <ckpt_path>/best (the best-eval checkpoint, --best_metric_key): one kept, outside this
        rotation, recording this run's id (built from here so the id cannot be left out)."""
        return CheckpointManager(best_checkpoints(self.root), 1, self.run_id)

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for the checkpoint of `step`, next to where it will be renamed to."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()  # not mkdtemp: its 0700 mode would stick to the final folder; this respects the umask
        write_owner(tmp, self.run_id)
        return tmp

    def commit(self, tmp: str | os.PathLike, step: int, meta: dict[str, Any]) -> Path:
        """Make `tmp` the complete checkpoint of `step` and rotate; returns its final path.

        `meta` is JSON-able and should hold "fingerprint" (config_fingerprint) and "roles" ({role: ranks}); it is
        stored with format, step, time and orlhf version added. For each role the folder must hold every rank's
        RNG file (a cheap proof that all ranks' writes reached the storage the driver sees). Everything is
        fsynced, meta.json written last, then one rename; a checkpoint of the same step already there is replaced.
        """
        from orlhf import __version__

        tmp = Path(tmp).absolute()
        if tmp.parent != self.root or not tmp.name.startswith(TMP_PREFIX):
            raise ValueError(f"{tmp} is not a folder from {type(self).__name__}.begin() in {self.root}")
        for role, ranks in (meta.get("roles") or {}).items():
            _check_ranks_wrote(tmp / role, role, ranks)
        full = {
            **meta,
            "format": FORMAT_VERSION,
            "step": int(step),
            "time": time.time(),
            "orlhf_version": __version__,
            "run_id": self.run_id,
        }
        fsync_tree(tmp)
        full["files"] = file_sizes(tmp)  # checked before a resume loads anything (files_problem)
        _write_json_durable(tmp / META, full)
        final = self.root / step_dir_name(step)
        old = self._trash(final) if final.exists() else None
        os.rename(tmp, final)
        fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        log.debug("checkpoint saved: %s", final)  # the controller says it, with the time it took
        self.rotate()
        return final

    def rotate(self) -> list[Path]:
        """Delete complete checkpoints beyond the newest max_ckpt_num, then, with a disk budget (max_ckpt_mem GiB),
        the oldest left while the checkpoints other than the newest, with <ckpt_path>/best, take more than it;
        returns the deleted paths.

        That is OpenRLHF's --max_ckpt_mem: before each save it deletes the oldest until what is already on disk (its
        best checkpoint included, never deleted) fits the budget, then writes the new one. Here rotation follows the
        commit, so a crash never leaves fewer checkpoints than before; the checkpoints kept after each save are the
        same, and the newest is never counted nor deleted. Sizes are the files' apparent sizes, as OpenRLHF's."""
        done = self.complete()
        keep = done[: self.max_ckpt_num] if self.max_ckpt_num >= 1 else done
        doomed = [(path, f"--max_ckpt_num {self.max_ckpt_num}") for path in done[len(keep) :]]
        budget = self.max_ckpt_mem
        if budget is not None and math.isfinite(budget) and len(keep) > 1:
            sizes = {path: tree_bytes(path) for path in keep[1:]}
            used = sum(sizes.values()) + tree_bytes(best_checkpoints(self.root))
            for path in reversed(keep[1:]):  # oldest first
                if used <= budget * GIB:
                    break
                used -= sizes[path]
                doomed.append((path, f"--max_ckpt_mem {budget:g} GiB"))
        for path, why in doomed:
            shutil.rmtree(self._trash(path), ignore_errors=True)
            log.info("checkpoint rotated out (%s): %s", why, path)
        return [path for path, _ in doomed]

    def complete(self) -> list[Path]:
        """Complete checkpoints, newest first. Logs (does not delete) everything it skips and why."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                log.info("ignoring %s: an unfinished save or deletion (cleanup_stale_tmp removes it)", entry)
                continue
            match = STEP_DIR.match(entry.name)
            if not match or not entry.is_dir():
                continue
            problem = _meta_problem(entry, int(match.group(1)))
            if problem:
                log.warning("ignoring %s: %s", entry, problem)
                continue
            found.append((int(match.group(1)), entry))
        return [path for _, path in sorted(found, reverse=True)]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, or None."""
        done = self.complete()
        return done[0] if done else None

    def check_new_run(self) -> None:
        """For a run that saves without --load_checkpoint: refuse a --ckpt_path that holds another run's
        checkpoints (rotation by step would delete this run's new, lower-numbered ones, and a later resume would
        pick the old run's)."""
        done = self.complete()
        if done:
            raise CheckpointError(
                f"--ckpt_path {self.root} already holds {len(done)} checkpoint(s), the newest {done[0].name}. Pass "
                "--load_checkpoint to resume from it, or choose another --ckpt_path (or delete those folders)."
            )

    def cleanup_stale_tmp(self) -> list[Path]:
        """Remove `.tmp-step_*` / `.trash-step_*` leftovers of crashed saves whose writer is gone (runlock.owner_gone;
        a trash folder is a complete checkpoint being deleted: nobody writes it). Call before the first save only
        (no save of this run may be in flight). Returns what was removed."""
        if not self.root.is_dir():
            return []
        entries = list(self.root.iterdir())
        return remove_stale(
            [e for e in entries if e.name.startswith(TMP_PREFIX + "step_")],
            "an unfinished checkpoint save",
            trash=[e for e in entries if e.name.startswith(TRASH_PREFIX + "step_")],
        )

    def _trash(self, path: Path) -> Path:
        trash = self.root / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)  # atomic: from here on nothing reads it as a checkpoint
        return trash


def tree_bytes(path: str | os.PathLike) -> int:
    """The apparent size of every file under `path` (0 when it does not exist); files that vanish meanwhile count 0."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a checkpoint folder; CheckpointError if missing or unreadable."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable {META} ({e}); it is not a complete orlhf checkpoint") from e


def file_sizes(folder: Path) -> dict[str, int]:
    """{path relative to `folder`: bytes} of every file a checkpoint holds (not meta.json, not the writer's record)."""
    sizes = {}
    for sub, _dirs, files in os.walk(folder):
        for name in files:
            rel = (Path(sub) / name).relative_to(folder).as_posix()
            if rel not in (META, OWNER_NAME):
                sizes[rel] = os.path.getsize(Path(sub) / name)
    return sizes


def _meta_problem(path: Path, step: int) -> Optional[str]:
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        return f"no {META} (not a complete orlhf checkpoint)"
    except (OSError, ValueError) as e:
        return f"unreadable {META} ({e})"
    return meta_problem(meta, step) or files_problem(meta, lambda name: _size(path / name))


def _size(path: Path) -> Optional[int]:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def _check_ranks_wrote(folder: Path, role: str, ranks: int) -> None:
    missing = [r for r in range(ranks) if not (folder / f"rng_rank{r}.json").exists()]
    if missing:
        raise CheckpointError(
            f"{folder}: ranks {missing} of the {role} group ({ranks} ranks) left no files here. Every rank must "
            "see --ckpt_path: on several nodes put it on a shared filesystem."
        )


# ---- durability ------------------------------------------------------------------------------------------------


def _write_json_durable(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)
