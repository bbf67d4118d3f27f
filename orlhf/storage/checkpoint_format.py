"""Checkpoint format, the pure side: folder names, meta.json's checks, the resume compatibility check, and the
encoding of driver/rank state as JSON + tensors. No file or Ray access here (storage/checkpoint.py does the IO).

    <ckpt_path>/step_000010/           step_dir_name(step); STEP_DIR recognises it
    <ckpt_path>/.tmp-step_.../         TMP_PREFIX: a save in progress; TRASH_PREFIX: a rotation in progress
    meta.json (META)                   {"format": FORMAT_VERSION, "step", "fingerprint", "roles", "files", ...}
        meta_problem(meta, step)       why a step folder's meta does not make it a complete checkpoint
        files_problem(meta, size_of)   which file of "files" ({path: bytes when saved}) is missing or truncated
        check_compatible(meta, fp)     every setting that differs between the checkpoint and this run
    state --encode_state--> JSON doc + {key: tensor} --decode_state--> state   (loading never unpickles code)
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
META = "meta.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


class CheckpointError(ValueError):
    """A checkpoint cannot be used by this run; the message names the folder, what differs, and the fix."""


def meta_problem(meta: Any, step: int) -> Optional[str]:
    """Why a parsed meta.json does not describe a complete checkpoint of `step` (None: it does)."""
    if not isinstance(meta, dict) or meta.get("step") != step:
        return f"{META} does not describe step {step}"
    return None


def files_problem(meta: dict[str, Any], size_of: Callable[[str], Optional[int]]) -> Optional[str]:
    """Why the files meta.json lists ({relative path: bytes when saved}) are not all there whole (None: they are),
    `size_of(path)` giving a file's size now (None: missing). Checked before anything loads, so a truncated or
    deleted file is named here instead of failing deep in DeepSpeed or torch. Checkpoints of an orlhf that did not
    record sizes have no "files": nothing to check."""
    files = meta.get("files")
    if not isinstance(files, dict):
        return None
    for name, saved in sorted(files.items()):
        now = size_of(name)
        if now is None:
            return f"{name} is missing ({saved} bytes when saved): not a complete checkpoint"
        if now != saved:
            return f"{name} has {now} bytes, {saved} when saved (truncated or overwritten): not a complete checkpoint"
    return None


# ---- does this checkpoint belong to this run? -----------------------------------------------------------------


def check_compatible(meta: dict[str, Any], fingerprint: dict[str, Any], path: str | os.PathLike = "") -> None:
    """Raise CheckpointError listing every setting that differs between the checkpoint and this run."""
    where = f"checkpoint {path}" if path else "the checkpoint"
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format {meta.get('format')!r}; this orlhf reads format {FORMAT_VERSION}. "
            "Resume with the orlhf version that wrote it, or start fresh with another --ckpt_path."
        )
    if meta.get("resumable") is False:
        raise CheckpointError(
            f"{where} was saved with --disable_ds_ckpt: it holds the HF actor (hf/actor) but no "
            "DeepSpeed state, so no run can resume from it. Start fresh (another --ckpt_path, or "
            "leave out --load_checkpoint), or save resumable checkpoints without --disable_ds_ckpt."
        )
    from orlhf.config.fingerprint import FREE_ON_RESUME

    saved = meta.get("fingerprint") or {}
    missing = object()
    free = {f"--{flag}" for flag in FREE_ON_RESUME}  # recorded by an older orlhf, argued free since
    diffs = [
        (k, saved.get(k, missing), fingerprint.get(k, missing))
        for k in sorted({*saved, *fingerprint} - free)
        if saved.get(k, missing) != fingerprint.get(k, missing)
    ]
    if diffs:
        show = lambda v: "(not recorded)" if v is missing else repr(v)  # noqa: E731
        lines = "\n".join(f"  - {k}: checkpoint {show(a)}, this run {show(b)}" for k, a, b in diffs)
        raise CheckpointError(
            f"{where} was written by a run with other settings:\n{lines}\nResume with the "
            "checkpoint's values of these flags, or start fresh: another --ckpt_path, or leave "
            "out --load_checkpoint."
        )


# ---- state as JSON + tensors -------------------------------------------------------------------------------


def encode_state(obj: Any, tensors: dict[str, torch.Tensor], key: str = "") -> Any:
    """`obj` as JSON-able data; its tensors moved into `tensors` (by dotted key), referenced as {"__tensor__": key},
    tuples as {"__tuple__": [...]}. Dict keys must be strings; leaves: None, bool, int, float, str, torch.Tensor."""
    import torch  # here, not at the top: the driver reads checkpoints' JSON before it imports torch

    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad or "__tensor__" in obj or "__tuple__" in obj:
            raise TypeError(f"state at {key or '<root>'!r}: keys must be strings other than __tensor__/__tuple__")
        return {k: encode_state(v, tensors, f"{key}.{k}" if key else k) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [encode_state(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"state at {key!r}: cannot store a {type(obj).__name__} (use plain values or tensors)")


def decode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Undo encode_state."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(decode_state(v, tensors) for v in obj["__tuple__"])
        return {k: decode_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    return obj
