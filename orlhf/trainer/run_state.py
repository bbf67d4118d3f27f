"""The controller's side of a checkpoint: what one holds beyond the model groups' own state, and how it returns.

    save_run(state, mgr):  tmp = mgr.begin(step) -> each trained group saves its DeepSpeed state (tmp/<role>)
        [--save_hf_ckpt / --disable_ds_ckpt: the actor as an HF folder, tmp/hf/actor] -> the controller's state
        (step, weight version, loader position, KL controller, reward normaliser, RNG, best eval score,
        the sync guard's calibration)
        -> mgr.commit (atomic rename; meta.json with the config fingerprint)
    restore_run(state, path): the groups load their state, then the controller's parts; returns the counters
        (Resumed) for the controller to take (the engines are re-synced by the caller)
`state` is a RunState, the controller's typed view of what a checkpoint holds (Controller.run_state): nothing else of
the controller is read here.
Async mode (--async_train) also keeps the batches generated ahead and not yet trained (the producer's queue, once
the generation in flight has ended: RolloutProducer.pending), so a resume trains them as the stopped run would have,
instead of generating their prompts again with other weights; their prompts are the loader's next batches.
A save that fails removes its temp folder once no rank writes there any more; a full disk raises NoSpaceError
(storage/disk_space.py), on which the controller keeps training (skipped_save says so) and saves at the next step.
The folder format and its atomic commit are storage/checkpoint.py's; this module only says what goes in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from orlhf.config.fingerprint import config_fingerprint
from orlhf.config.provenance import dump_resolved
from orlhf.storage.checkpoint import read_meta
from orlhf.storage.checkpoint_state import load_controller_state, rng_state, save_controller_state, set_rng_state
from orlhf.storage.disk_space import NoSpaceError, cleanup_after_failed_write
from orlhf.storage.logs import TRACE
from orlhf.storage.run_folder import checkpoint_config, checkpoint_hf_actor
from orlhf.trainer.async_producer import KeptBatch
from orlhf.types import Rollout
from orlhf.workers import PolicyWorker
from orlhf.workers.base import DeepSpeedWorker

if TYPE_CHECKING:
    from orlhf.algo.kl import KLController
    from orlhf.algo.rewards import RunningMoments
    from orlhf.config.train_config import TrainConfig
    from orlhf.inputs.prompt_loader import PromptLoader
    from orlhf.trainer.async_producer import RolloutProducer
    from orlhf.trainer.engine_restart import EngineRestarts
    from orlhf.trainer.evaluation import Evaluator
    from orlhf.trainer.models import Models
    from orlhf.trainer.sync_guard import SyncGuard

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What a checkpoint holds of the controller's run: the counters by value, the parts with a state of their own by
    reference (each saves and loads its own state_dict, so a resume puts it back in place). Built by
    Controller.run_state() at each save and resume."""

    cfg: TrainConfig
    models: Models  # the trained groups save and load their DeepSpeed state; the actor also its HF folder
    step_index: int  # steps done
    weight_version: int  # what the engines hold after the step's sync
    loader: PromptLoader  # its position: the batches consumed (state_dict, steps_per_episode)
    loader_reads_ahead: bool  # --dynamic_filtering: refills read more batches than steps: its own position is saved
    kl_ctl: KLController
    reward_norm: Optional[RunningMoments]  # --normalize_reward's running statistics, None without
    evaluator: Optional[Evaluator]  # --eval_dataset: its best score so far
    restarts: EngineRestarts  # the engines replaced so far: --max_engine_restarts counts the whole run's
    guard: SyncGuard  # the sync guard's calibration: a resume's first step follows a sync
    producer: Optional[RolloutProducer]  # async mode: the batches generated ahead and not yet trained


@dataclass(frozen=True)
class Resumed:
    """The counters a checkpoint gives back to the controller (restore_run); the rest was loaded in place."""

    step_index: int
    weight_version: int
    pending: tuple[KeptBatch, ...]  # the batches the checkpoint kept, for the producer


def save_run(state: RunState, mgr) -> Path:
    """Write step state.step_index into `mgr` (the rotation's or the best-eval manager); returns its folder.

    A failed save removes its temp folder (once every rank's call has returned: none still writes there) and raises;
    a full disk as storage.disk_space.NoSpaceError, measured before that removal frees the space again. The
    checkpoints already there are untouched (rotation follows the commit)."""
    step, tmp = state.step_index, None
    try:
        tmp = mgr.begin(step)
        return _write_run(state, mgr, tmp, step)
    except Exception as e:
        cleanup_after_failed_write(e, mgr.root, tmp)  # (tmp lives there: the same filesystem)


def _write_run(state: RunState, mgr, tmp: Path, step: int) -> Path:
    cfg = state.cfg
    hf_only = cfg.logging.disable_ds_ckpt  # no DeepSpeed state, no resume
    trained = [] if hf_only else state.models.trained()
    wait_all([g.call(DeepSpeedWorker.save_checkpoint, str(tmp / role)) for role, g in trained])
    if cfg.logging.save_hf_ckpt or hf_only:  # after: both are collectives on the actor ranks, never interleaved
        state.models.actor.call(PolicyWorker.save_hf, str(checkpoint_hf_actor(tmp))).get()
    checkpoint_config(tmp).write_text(dump_resolved(cfg))  # what a resume's refusal names the sources from
    spe = state.loader.steps_per_episode  # loader position of the consumed batches (async reads ahead)
    loader_state = {**state.loader.state_dict(), "episode": step // spe, "batch_in_episode": step % spe}
    if state.loader_reads_ahead:  # refills read more batches than steps (sync only): the loader's own position
        loader_state = state.loader.state_dict()
    save_controller_state(
        tmp,
        {
            "step_index": step,
            "weight_version": state.weight_version,
            "loader": loader_state,
            "kl_ctl": state.kl_ctl.state_dict(),
            "reward_norm": state.reward_norm.state_dict() if state.reward_norm else None,
            "rng": rng_state(),
            "best_eval": state.evaluator.best if state.evaluator else None,
            "engine_restarts": state.restarts.count,
            "sync_guard": state.guard.state_dict(),
            "pending": pending_batches(state),
        },
    )
    return mgr.commit(
        tmp,
        step,
        {
            "fingerprint": config_fingerprint(cfg),
            "roles": {role: g.world_size for role, g in trained},
            **({"resumable": False} if hf_only else {}),
        },
    )


def skipped_save(error: NoSpaceError, mgr, step: int, last: bool = False) -> str:
    """The line for a save the full disk refused: the run goes on, or, at its `last` save (--stop_after_steps, a
    stop signal, the last step), ends without that checkpoint."""
    kept = mgr.latest()
    newest = f"the newest is still {kept}" if kept else "none saved yet"
    if last:
        return (
            f"{error}: the checkpoint of step {step} was not saved ({newest}); it was this run's last save, so the "
            f"run ends without it and --load_checkpoint continues from {kept or 'the start'}. Free space there or "
            "pass another --ckpt_path."
        )
    return (
        f"{error}: the checkpoint of step {step} was not saved ({newest}); the run goes on and the next save tries "
        "again. Free space there or pass another --ckpt_path."
    )


def missing_checkpoint(ctl) -> str:
    """For the run's last line: "" unless its last save was refused by a full disk; then which step has no
    checkpoint and where --load_checkpoint continues instead."""
    if ctl.checkpoints is None or ctl.unsaved_step is None:
        return ""
    kept = ctl.checkpoints.latest()
    return (
        f"; no checkpoint of step {ctl.unsaved_step} (the disk was full): --load_checkpoint continues from "
        f"{kept or 'the start'}"
    )


def foreign_checkpoint(mgr) -> Optional[Path]:
    """The newest complete checkpoint in `mgr`'s folder that another run (another run id) wrote, or None."""
    return next((p for p in mgr.complete() if read_meta(p).get("run_id") != mgr.run_id), None)


def may_save_at_stop(stop_signal: Optional[str], step_index: int, first_step: int, mgr) -> bool:
    """Whether a stop saves: always at --stop_after_steps; at a stop signal not before the first step of this
    invocation (nothing new), nor into a --ckpt_path (`mgr`) holding another run's checkpoints (a run that saves
    nothing otherwise was not refused such a folder at its start, launch/run.py find_checkpoint; said in one line)."""
    if stop_signal is None:
        return True
    if step_index == first_step:
        return False
    other = foreign_checkpoint(mgr)
    if other is not None:
        log.warning("no checkpoint at the stop: %s holds another run's checkpoint %s", other.parent, other)
    return other is None


def wait_all(calls: list) -> None:
    """Wait for every call, then raise the first failure: a failed rank must not leave the others still writing."""
    errors = []
    for call in calls:
        try:
            call.get()
        except Exception as e:  # noqa: BLE001 - raised below, once nothing is in flight
            errors.append(e)
    if errors:
        raise errors[0]


def restore_run(state: RunState, path: Path) -> Resumed:
    """Load what save_run wrote into the (init()-ed) groups and the run's parts; returns the counters."""
    for call in [g.call(DeepSpeedWorker.load_checkpoint, str(path / role)) for role, g in state.models.trained()]:
        call.get()
    saved = load_controller_state(path)
    state.loader.load_state_dict(saved["loader"])
    state.kl_ctl.load_state_dict(saved["kl_ctl"])
    if state.reward_norm is not None:
        state.reward_norm.load_state_dict(saved["reward_norm"])
    set_rng_state(saved["rng"])
    if state.evaluator is not None:
        state.evaluator.best = saved.get("best_eval")
    state.restarts.count = saved.get("engine_restarts", 0)
    state.guard.load_state_dict(saved.get("sync_guard"))
    pending = tuple(KeptBatch(unpack_rollouts(b["rollouts"]), b["seconds"]) for b in saved.get("pending", []))
    if pending:
        log.info("%d batch(es) generated before the checkpoint are trained first, as they were", len(pending))
    return Resumed(saved["step_index"], saved["weight_version"], pending)


# Rollout's per-token lists, stored as flat tensors (logprobs in float64: Python's floats exactly)
TOKEN_FIELDS = ("prompt_ids", "response_ids", "logprobs", "action_mask", "token_versions")


def pending_batches(state: RunState) -> list[dict]:
    """Async mode: the producer's batches generated ahead and not yet trained, as the checkpoint keeps them; filled
    batches (--dynamic_filtering) are left out, said in one line."""
    if state.producer is None:
        return []
    kept, left_out = state.producer.pending()
    if left_out:
        log.warning(
            "--dynamic_filtering: the %d batch(es) generated ahead are not kept in the checkpoint of step %d; a resume "
            "goes on with the prompts after them",
            left_out,
            state.step_index,
        )
    return [{"rollouts": pack_rollouts(batch.rollouts), "seconds": batch.seconds} for batch in kept]


def pack_rollouts(rollouts: list[Rollout]) -> dict:
    """Rollouts as save_state stores them: each per-token field one flat tensor and one length per rollout (-1:
    None), the other fields as they are."""
    import torch

    rows = [
        {f.name: getattr(r, f.name) for f in dataclasses.fields(Rollout) if f.name not in TOKEN_FIELDS}
        for r in rollouts
    ]
    packed: dict = {"rows": rows}
    for name in TOKEN_FIELDS:
        values = [getattr(r, name) for r in rollouts]
        dtype = torch.float64 if name == "logprobs" else torch.int64
        packed[name] = torch.tensor([x for v in values if v is not None for x in v], dtype=dtype)
        packed[f"{name}_lengths"] = torch.tensor([-1 if v is None else len(v) for v in values], dtype=torch.int64)
    return packed


def unpack_rollouts(packed: dict) -> list[Rollout]:
    """Undo pack_rollouts."""
    columns = {}
    for name in TOKEN_FIELDS:
        flat, at, column = packed[name].tolist(), 0, []
        for n in packed[f"{name}_lengths"].tolist():
            column.append(None if n < 0 else flat[at : at + n])
            at += max(n, 0)
        columns[name] = column
    return [Rollout(**row, **{k: v[i] for k, v in columns.items()}) for i, row in enumerate(packed["rows"])]


class CheckpointSteps:
    """The Controller's checkpoint steps, in their call order (the folder format is storage/checkpoint.py's): stop
    on a step boundary (--stop_after_steps, a signal) and save there, save every --save_steps, resume. Mixed into
    trainer/controller.py's Controller, whose counters (step_index, first_step, checkpoints, ...) they read; what a
    checkpoint holds comes from its run_state()."""

    saving = False  # a checkpoint of this step is being written (a stop signal lets it finish: launch/stop_signals.py)
    producer = None  # async mode: the RolloutProducer of fit_async, whose generated batches a checkpoint keeps
    pending: tuple[KeptBatch, ...] = ()  # the batches a resumed checkpoint kept, for the producer
    unsaved_step: Optional[int] = None  # the step whose save a full disk refused, until a later save succeeds

    def should_stop(self) -> bool:
        """--stop_after_steps: end this invocation early, on a step boundary, keeping the full run's schedule."""
        n = self.cfg.runtime.stop_after_steps
        return self.stop_signal is not None or (n is not None and self.step_index - self.first_step >= n)

    def save_at_stop(self) -> None:
        """--stop_after_steps or a stop signal ended this invocation: save where it stopped (unless that step is
        saved already), so the later --load_checkpoint continues from here, not from the last --save_steps multiple
        (a signal's exceptions: run_state.may_save_at_stop)."""
        if (
            self.checkpoints is not None
            and self._saved_step != self.step_index
            and may_save_at_stop(self.stop_signal, self.step_index, self.first_step, self.checkpoints)
        ):
            self.save_checkpoint()

    def save_checkpoint(self, mgr=None) -> Optional[Path]:
        """Every trained group's DeepSpeed state + the controller's, into a temp folder renamed into place. Returns
        its folder, or None when the disk was full: the run goes on, the newest good checkpoint stays, the next save
        tries again (said in one line)."""
        t0, mgr = time.perf_counter(), mgr or self.checkpoints
        self.saving = True
        logging.getLogger(TRACE).info("step %d: checkpoint", self.step_index)
        try:
            path = save_run(self.run_state(), mgr)
        except NoSpaceError as e:
            ours = mgr is self.checkpoints  # the best-eval copy is not the rotation's save of this step
            last = ours and (self.should_stop() or self.step_index >= self.loader.total_steps)
            log.warning("%s", skipped_save(e, mgr, self.step_index, last))
            if ours:
                self.unsaved_step = self.step_index
            return None
        finally:
            self.saving = False
        if mgr is self.checkpoints:
            self._saved_step, self.unsaved_step = self.step_index, None
        log.info("checkpoint %s (%.1f s)", path, time.perf_counter() - t0)
        return path

    def resume(self, path) -> None:
        """Load a checkpoint written by save_checkpoint (groups already init()-ed), then re-sync the engines,
        which still hold the initial weights, before the first generation."""
        resumed = restore_run(self.run_state(), path)
        self.step_index, self.weight_version, self.pending = resumed.step_index, resumed.weight_version, resumed.pending
        self.first_step = self._saved_step = self.step_index
        self.m.rollout.load_weights(self.weight_version)
        log.info("resumed from %s at step %d (weight version %d)", path, self.step_index, self.weight_version)
