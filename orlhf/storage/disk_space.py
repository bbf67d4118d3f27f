"""A write that failed because its filesystem is full, told apart from other failures and said in one line.

A full disk reaches the driver in several disguises: an OSError with errno ENOSPC (or EDQUOT, a quota) from a write
here; a rank's traceback as text (Ray passes remote errors on as strings: "OSError: [Errno 28] No space left on
device", safetensors' "StorageFull"); or torch's checkpoint writer, whose "[enforce fail at inline_container.cc]
... file write failed" carries no errno at all. So a failure counts as "no space" when

    an ENOSPC / EDQUOT OSError is in its chain (__cause__, __context__), or its text names one, or
    the filesystem it wrote to has (almost) nothing free left, measured right after the failure
    (before the partial folder is removed, which would free the space again)

    no_space_error(error, path) -> NoSpaceError (its message: "no space left on <path> (<free> free)") or None

Before Ray starts, run_disk_needs(cfg) says what the run will write on each filesystem (its final models and logs
in --save_path, the checkpoints it keeps in --ckpt_path) against what is free there, and check_disk_space says it in
one line (launch/run.py calls it). What the run cannot do without (must_writes: the final model(s) exported into
--save_path; one checkpoint in --ckpt_path when it saves any), each alone larger than its filesystem's free space, is
a DiskSpaceError instead, unless --ignore_disk_space: training into a certain failure costs the whole run.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from orlhf.config.train_config import TrainConfig

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


class DiskSpaceError(ValueError):
    """Before the first step: what the run must write cannot fit where it goes (check_disk_space); str() is one line
    naming the folder, its free space, what needs how much, and --ignore_disk_space."""


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


# ---- what a run will write, against what is free (before the first step) ----

LOG_BYTES = 64 * 1024**2  # logs, metrics, figures and the report of one run: generously above what runs write
ADAM_BYTES = 12  # per trained parameter in a DeepSpeed checkpoint: fp32 master weights, Adam's two moments


@dataclass(frozen=True)
class DiskNeed:
    """What a run writes on one filesystem: `parts` {what: bytes}, the first of its folders named `folder`."""

    folder: Path
    free: Optional[int]
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def short(self) -> bool:
        return self.free is not None and self.free < self.total

    def line(self) -> str:
        free = human_bytes(self.free) if self.free is not None else "unknown space"
        parts = ", ".join(f"{what} {human_bytes(n)}" for what, n in self.parts.items())
        return f"{self.folder} has {free} free for up to {human_bytes(self.total)} ({parts})"


def run_disk_needs(cfg: "TrainConfig") -> list[DiskNeed]:
    """What the run will write into --save_path (final models, logs) and --ckpt_path (the checkpoints it keeps at
    once, plus the one being written before the oldest is deleted), by filesystem. Sizes come from the model folders'
    safetensors headers (parameter counts); a model whose folder has none (a hub id) counts 0."""
    lg = cfg.logging
    by_fs: dict[object, DiskNeed] = {}
    for folder, parts in (
        (lg.save_path, {**final_models(cfg), "logs": LOG_BYTES}),
        (lg.checkpoint_dir, checkpoints(cfg)),
    ):
        parts = {k: v for k, v in parts.items() if v}
        key = _filesystem(folder)
        if key in by_fs:
            by_fs[key].parts.update(parts)
        elif parts:
            by_fs[key] = DiskNeed(Path(folder).absolute(), free_bytes(folder), dict(parts))
    return list(by_fs.values())


def final_models(cfg: "TrainConfig") -> dict[str, int]:
    """{what: bytes} exported into --save_path at the end: the actor (with LoRA the adapter, plus the merged actor
    with --lora_save_merged) at the training dtype, and the critic with --save_value_network."""
    from orlhf.config.roles import model_path, trained_roles

    w = _dtype_bytes(cfg)
    actor = model_numel(model_path(cfg, "actor"))
    adapter = lora_numel(model_path(cfg, "actor"), cfg.lora.lora_rank) if cfg.lora.enabled else 0
    final = {"final model": w * (adapter or actor) + (w * actor if cfg.lora.lora_save_merged else 0)}
    if cfg.logging.save_value_network and "critic" in trained_roles(cfg):
        final["critic"] = w * model_numel(model_path(cfg, "critic"))
    return final


def one_checkpoint(cfg: "TrainConfig") -> int:
    """Bytes of one checkpoint, 0 when the run saves none: each trained role's DeepSpeed state (weights, and fp32
    masters and Adam's moments of what trains), the HF actor with --save_hf_ckpt (alone with --disable_ds_ckpt)."""
    from orlhf.config.roles import model_path, trained_roles

    lg, w = cfg.logging, _dtype_bytes(cfg)
    if lg.save_steps <= 0 and cfg.runtime.stop_after_steps is None:
        return 0
    one = 0
    for role in trained_roles(cfg):
        n = model_numel(model_path(cfg, role))
        trained = lora_numel(model_path(cfg, role), cfg.lora.lora_rank) if cfg.lora.enabled else n
        one += 0 if lg.disable_ds_ckpt else w * n + ADAM_BYTES * trained
    return one + (w * model_numel(model_path(cfg, "actor")) if lg.save_hf_ckpt or lg.disable_ds_ckpt else 0)


def checkpoints(cfg: "TrainConfig") -> dict[str, int]:
    """{"<n> checkpoints": bytes} of the checkpoints the run holds at once beyond those already there (none when it
    saves none): one_checkpoint each, the best evaluation's in best/ too."""
    lg, one = cfg.logging, one_checkpoint(cfg)
    if not one:
        return {}
    held = lg.max_ckpt_num + 1 if lg.save_steps > 0 else 1  # else only --stop_after_steps's
    if lg.max_ckpt_mem is not None:
        held = min(held, int(lg.max_ckpt_mem * 1024**3 // one) + 2)  # the budget, the newest, the one being written
    there = len(list(Path(lg.checkpoint_dir).glob("step_*"))) if Path(lg.checkpoint_dir).is_dir() else 0
    held = max(1, held - there) + (1 if cfg.eval.eval_dataset and cfg.eval.best_metric else 0)
    return {f"{held} checkpoint{'s' * (held > 1)}": held * one}


def _dtype_bytes(cfg: "TrainConfig") -> int:
    return 2 if cfg.deepspeed.bf16 else 4


def model_numel(folder: Optional[str]) -> int:
    """Parameters in a model folder's safetensors files (headers only), 0 where there are none to read."""
    from orlhf.inputs.model_files import safetensors_header

    total = 0
    for path in Path(folder or "").expanduser().glob("*.safetensors") if folder else ():
        try:
            total += sum(math.prod(t["shape"]) for t in safetensors_header(path).values())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return total


def lora_numel(folder: Optional[str], rank: int) -> int:
    """A bound on a LoRA adapter's parameters: rank x (in + out) of every 2-D weight but the embeddings and head."""
    from orlhf.inputs.model_files import safetensors_header

    total = 0
    for path in Path(folder or "").expanduser().glob("*.safetensors") if folder else ():
        try:
            for name, t in safetensors_header(path).items():
                if len(t["shape"]) == 2 and not any(k in name for k in ("embed", "lm_head", "wte", "wpe")):
                    total += rank * sum(t["shape"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return total


def same_filesystem(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two folders (or their nearest existing parents) are on one filesystem."""
    return _filesystem(a) == _filesystem(b)


def _filesystem(folder: str | os.PathLike) -> object:
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.stat(p).st_dev
    except OSError:
        return str(p)


@dataclass(frozen=True)
class MustWrite:
    """What the run cannot do without: `what`, `need` bytes into `folder` (set by `flag`), `free` there; `then` says
    what happens where it does not fit."""

    what: str
    need: int
    folder: Path
    flag: str
    free: Optional[int]
    then: str

    @property
    def fits(self) -> bool:
        return self.free is None or self.need <= self.free

    def line(self) -> str:
        return (
            f"{self.folder} ({self.flag}) has {human_bytes(self.free or 0)} free and {self.what} needs "
            f"{human_bytes(self.need)}, so {self.then}"
        )


def must_writes(cfg: "TrainConfig") -> list[MustWrite]:
    """Each alone, as the least the run writes: the final model(s) into --save_path; one checkpoint into --ckpt_path
    when the run saves any (several kept at once, and the logs, are what may not fit: run_disk_needs)."""
    lg, final = cfg.logging, {k: v for k, v in final_models(cfg).items() if v}
    what = "the final model" + (" and critic" if "critic" in final else "")
    folder, then = Path(lg.save_path).absolute(), "its export would fail at the end, after all the training"
    out = [MustWrite(what, sum(final.values()), folder, "--save_path", free_bytes(folder), then)]
    one = one_checkpoint(cfg)
    if one:
        folder, then = Path(lg.checkpoint_dir).absolute(), "every checkpoint the run saves would fail"
        out.append(MustWrite("one checkpoint", one, folder, "--ckpt_path", free_bytes(folder), then))
    return out


def check_disk_space(cfg: "TrainConfig") -> None:
    """Before Ray starts: a DiskSpaceError where what the run must write cannot fit (must_writes), unless
    --ignore_disk_space; else what it will write on each filesystem against its free space (run_disk_needs) in one
    line, a warning when a filesystem lacks room for all of it (the final model not fitting means the export at the
    end fails; a full disk at a save costs that checkpoint, and the run goes on)."""
    import logging

    refused = [m for m in must_writes(cfg) if not m.fits]
    if refused and not cfg.logging.ignore_disk_space:
        flags = " / ".join(dict.fromkeys(m.flag for m in refused))
        raise DiskSpaceError(
            "not enough disk space: " + "; ".join(m.line() for m in refused) + f". Free space there, give {flags} "
            "on a larger disk, or pass --ignore_disk_space to start anyway."
        )
    needs = run_disk_needs(cfg)
    line = "disk: " + "; ".join(n.line() for n in needs)
    short = [n for n in needs if n.short]
    if not short:
        logging.getLogger("orlhf").info("%s", line)
        return
    final = any("final model" in n.parts for n in short)
    what = "the final model may not fit at the end" if final else "a save that finds the disk full is skipped"
    logging.getLogger("orlhf").warning("%s: not enough for all of it (%s)", line, what)
