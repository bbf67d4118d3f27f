"""What a trained role's DeepSpeed checkpoint can be loaded into: the rank count and ZeRO stage that wrote it, read
from the checkpoint itself, and the rule for each pair with this run's (--use_ds_universal_ckpt).

    <checkpoint>/<role>/latest                    the tag, global_step<N>
    <checkpoint>/<role>/rng_rank<r>.json          one per rank that saved: the rank count
    <checkpoint>/<role>/<tag>/*model_states.pt    DeepSpeed's config as it trained ("ds_config"): the ZeRO stage and
                                                  the optimizer; opened weights-only with its tensors mapped, not read
    <checkpoint>/<role>_universal/<tag>/          the universal copy for another rank count (workers/universal_ckpt.py)

    read_layout(folder, role) -> Layout --load_plan(...)--> AS_SAVED | UNIVERSAL, or CheckpointError (one line)
    check_resume(path, cfg): the same for every trained role of a run, before anything starts

The rules, as DeepSpeed 0.19.8 loads (each checked on CPU with gloo):
- The same rank count loads as saved, flag or not, into the stage that saved it: a ZeRO checkpoint holds its
  optimizer's own partition layout (ZeRO-1 into ZeRO-2 fails inside DeepSpeed).
- Another rank count needs --use_ds_universal_ckpt. ZeRO-1/2/3: converted by DeepSpeed's ds_to_universal and loaded
  as universal, ZeRO-1 and ZeRO-2 into each other (one optimizer class), ZeRO-3 into ZeRO-3 only (its universal
  optimizer_state.pt and model-state files are laid out otherwise). ZeRO-0 keeps whole copies on every rank: loaded
  as saved, no conversion; it neither converts nor loads a universal checkpoint. Muon: the conversion reads Adam's
  two moments only.
- A refusal names everything to pass at once (the flag and the --zero_stage the conversion loads into), so the
  next start is the one that resumes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from orlhf.demo.builder import deepspeed_quiet
from orlhf.storage.checkpoint_format import CheckpointError

if TYPE_CHECKING:
    from orlhf.config.train_config import TrainConfig

AS_SAVED, UNIVERSAL = "as saved", "universal"
UNIVERSAL_SUFFIX = "_universal"  # <checkpoint>/<role>_universal


@dataclass(frozen=True)
class Layout:
    ranks: int  # ranks that saved (0: no checkpoint of the role here)
    tag: Optional[str] = None  # DeepSpeed's tag, global_step<N>
    stage: Optional[int] = None  # ZeRO stage it trained under (None: not recorded)
    optimizer: str = "adam"  # "muon" when DeepSpeed built Muon from its config


def read_layout(folder: str | os.PathLike) -> Layout:
    """The layout of <checkpoint>/<role>; ranks 0 when no rank saved there. CheckpointError when ranks saved but
    DeepSpeed's `latest` or model-state file is missing."""
    from orlhf.storage.checkpoint_state import safe_torch_load

    folder = Path(folder)
    names = os.listdir(folder) if folder.is_dir() else []
    ranks = len([n for n in names if re.fullmatch(r"rng_rank\d+\.json", n)])
    if ranks == 0:
        return Layout(0)
    try:
        tag = (folder / "latest").read_text().strip()
    except OSError as e:
        raise CheckpointError(f"{folder}: no DeepSpeed checkpoint here ({e})") from e
    files = sorted((folder / tag).glob("*model_states.pt")) if (folder / tag).is_dir() else []
    files = [f for f in files if not f.name.startswith("layer_")]  # MoE expert files carry no config
    if not files:
        raise CheckpointError(f"{folder / tag}: no DeepSpeed model-state file: not a complete checkpoint")
    with deepspeed_quiet():  # the driver imports DeepSpeed here, before Ray starts: its notices are not the run's
        ds = safe_torch_load(files[0], map_location="cpu", mmap=True).get("ds_config") or {}
    stage = ds.get("zero_optimization", {}).get("stage")
    optimizer = str(ds.get("optimizer", {}).get("type", "adam")).lower()
    return Layout(ranks, tag, None if stage is None else int(stage), optimizer)


def _family(stage: Optional[int]) -> str:
    return {0: "ZeRO-0", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "ZeRO-3"}.get(stage, f"ZeRO-{stage}")


def load_plan(role: str, layout: Layout, ranks: int, stage: int, universal: bool, where: str | os.PathLike) -> str:
    """AS_SAVED or UNIVERSAL for loading `layout` into a `role` group of `ranks` ranks under ZeRO-`stage`; a
    CheckpointError saying what to pass instead when neither can (the rules in the module docstring). `where`: the
    folder, for the message."""
    if layout.ranks == 0:
        raise CheckpointError(f"{where}: written by 0 {role} ranks, this group has {ranks}: no {role} checkpoint here")
    saved = f"ZeRO-{layout.stage}" if layout.stage is not None else "an unrecorded ZeRO stage"
    if layout.ranks == ranks:
        if layout.stage is None or layout.stage == stage:
            return AS_SAVED
        raise CheckpointError(
            f"{where}: the {role}'s DeepSpeed state was saved under {saved}, this run trains the {role} under "
            f"ZeRO-{stage}; DeepSpeed loads it only into the stage that saved it: resume with --zero_stage "
            f"{layout.stage}"
        )
    if layout.optimizer == "muon":
        raise CheckpointError(
            f"{where}: the {role} trained with Muon, and DeepSpeed 0.19.8's universal conversion reads Adam's moments "
            f"only: this checkpoint resumes on {layout.ranks} {role} ranks only"
        )
    if layout.stage is None:
        raise CheckpointError(
            f"{where}: the {role}'s DeepSpeed state does not record its ZeRO stage, so it cannot be converted: resume "
            f"on {layout.ranks} {role} ranks"
        )
    # What the conversion can load into (ZeRO-0 keeps whole copies: nothing to convert); what to pass, all at once.
    loads = (_family(layout.stage) == _family(stage) and stage != 0) or layout.stage == stage == 0
    if universal and loads:
        return AS_SAVED if stage == 0 else UNIVERSAL
    fix = ([] if universal else ["--use_ds_universal_ckpt"]) + ([] if loads else [f"--zero_stage {layout.stage}"])
    why = (
        ""
        if loads
        else "; ZeRO-0 neither converts nor loads a universal checkpoint"
        if 0 in (layout.stage, stage)
        else "; DeepSpeed 0.19.8 loads a universal checkpoint only into the stage family that wrote it "
        "(ZeRO-1/2, or ZeRO-3)"
    )
    raise CheckpointError(
        f"{where}: the {role}'s DeepSpeed state was saved under {saved} on {layout.ranks} ranks, this run trains the "
        f"{role} under ZeRO-{stage} on {ranks}{why}: resume with {' '.join(fix)}, or on {layout.ranks} {role} ranks"
    )


def check_resume(path: str | os.PathLike, cfg: "TrainConfig") -> dict[str, str]:
    """{trained role: AS_SAVED | UNIVERSAL} for resuming `cfg`'s run from the checkpoint folder `path`; roles that
    cannot load raise one CheckpointError, a line for each, and with several trained roles a last line with what
    loads them all (one --zero_stage serves every role), or that nothing does on these rank counts. Reads file
    names and each role's model-state config only, so the driver can call it before Ray starts; the ranks check
    the same again when they load."""
    from orlhf.config.roles import trained_roles
    from orlhf.config.worker_config import role_ranks, zero_stage_for

    path = Path(path)
    layouts = {role: read_layout(path / role) for role in trained_roles(cfg)}

    def plans(universal: bool, stage: Optional[int] = None) -> tuple[dict[str, str], list[str]]:
        done, refused = {}, []
        for role, layout in layouts.items():
            now = zero_stage_for(cfg, role) if stage is None else stage
            try:
                done[role] = load_plan(role, layout, role_ranks(cfg, role), now, universal, path / role)
            except CheckpointError as e:
                refused.append(str(e))
        return done, refused

    done, refused = plans(cfg.logging.use_ds_universal_ckpt)
    if not refused:
        return done
    if len(layouts) > 1:
        refused.append(_fix_for_all(plans, cfg, {role: layout.ranks for role, layout in layouts.items()}))
    raise CheckpointError("\n".join(refused))


def _fix_for_all(plans, cfg: "TrainConfig", saved_ranks: dict[str, int]) -> str:
    """The one line naming flags that load every role (check_resume's `plans` tried with the universal conversion
    at this run's stages, then at each --zero_stage), or saying that no single stage does."""
    for stage in (None, 0, 1, 2, 3):
        if not plans(True, stage)[1]:
            fix = [] if cfg.logging.use_ds_universal_ckpt else ["--use_ds_universal_ckpt"]
            fix += [] if stage is None or stage == cfg.deepspeed.zero_stage else [f"--zero_stage {stage}"]
            return f"every role loads with: {' '.join(fix)}"
    counts = ", ".join(f"{role} {n}" for role, n in saved_ranks.items())
    return (
        "no one --zero_stage (it is the same for every role) loads every role on this run's rank counts: resume on "
        f"the rank counts that saved them ({counts})"
    )
