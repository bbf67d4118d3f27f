"""The controller's side of a checkpoint: what one holds beyond the model groups' own state, and how it returns.

    save_run(ctl, mgr):  tmp = mgr.begin(step) -> each trained group saves its DeepSpeed state (tmp/<role>)
        [--save_hf_ckpt / --disable_ds_ckpt: the actor as an HF folder, tmp/hf/actor] -> the controller's state
        (step, weight version, loader position, KL controller, reward normaliser, RNG, best eval score)
        -> mgr.commit (atomic rename; meta.json with the config fingerprint)
    restore_run(ctl, path): the groups load their state, then the controller's (the engines are re-synced by
        the caller)
A save that fails removes its temp folder once no rank writes there any more; a full disk raises NoSpaceError
(storage/disk_space.py), on which the controller keeps training (skipped_save says so) and saves at the next step.
The folder format and its atomic commit are storage/checkpoint.py's; this module only says what goes in.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from orlhf.config.fingerprint import config_fingerprint
from orlhf.config.provenance import dump_resolved
from orlhf.storage.checkpoint import load_controller_state, read_meta, rng_state, save_controller_state, set_rng_state
from orlhf.storage.disk_space import NoSpaceError, cleanup_after_failed_write
from orlhf.storage.run_folder import checkpoint_config, checkpoint_hf_actor
from orlhf.workers import PolicyWorker
from orlhf.workers.base import DeepSpeedWorker

log = logging.getLogger(__name__)


def save_run(ctl, mgr) -> Path:
    """Write step ctl.step_index into `mgr` (the rotation's or the best-eval manager); returns its folder.

    A failed save removes its temp folder (once every rank's call has returned: none still writes there) and raises;
    a full disk as storage.disk_space.NoSpaceError, measured before that removal frees the space again. The
    checkpoints already there are untouched (rotation follows the commit)."""
    step, tmp = ctl.step_index, None
    try:
        tmp = mgr.begin(step)
        return _write_run(ctl, mgr, tmp, step)
    except Exception as e:
        cleanup_after_failed_write(e, mgr.root, tmp)  # (tmp lives there: the same filesystem)


def _write_run(ctl, mgr, tmp: Path, step: int) -> Path:
    hf_only = ctl.cfg.logging.disable_ds_ckpt  # no DeepSpeed state, no resume
    trained = [] if hf_only else ctl.m.trained()
    wait_all([g.call(DeepSpeedWorker.save_checkpoint, str(tmp / role)) for role, g in trained])
    if ctl.cfg.logging.save_hf_ckpt or hf_only:  # after: both are collectives on the actor ranks, never interleaved
        ctl.m.actor.call(PolicyWorker.save_hf, str(checkpoint_hf_actor(tmp))).get()
    checkpoint_config(tmp).write_text(dump_resolved(ctl.cfg))  # what a resume's refusal names the sources from
    spe = ctl.loader.steps_per_episode  # loader position of the consumed batches (async reads ahead)
    loader_state = {**ctl.loader.state_dict(), "episode": step // spe, "batch_in_episode": step % spe}
    if ctl.filter is not None:  # refills read more batches than steps (sync only): the loader's own position
        loader_state = ctl.loader.state_dict()
    save_controller_state(
        tmp,
        {
            "step_index": step,
            "weight_version": ctl.weight_version,
            "loader": loader_state,
            "kl_ctl": ctl.kl_ctl.state_dict(),
            "reward_norm": ctl.scorer.reward_norm.state_dict() if ctl.scorer.reward_norm else None,
            "rng": rng_state(),
            "best_eval": ctl.evaluator.best if ctl.evaluator else None,
            "engine_restarts": ctl.restarts.count,  # the budget of --max_engine_restarts is the whole run's
        },
    )
    return mgr.commit(
        tmp,
        step,
        {
            "fingerprint": config_fingerprint(ctl.cfg),
            "roles": {role: g.world_size for role, g in trained},
            **({"resumable": False} if hf_only else {}),
        },
    )


def skipped_save(error: NoSpaceError, mgr, step: int) -> str:
    """The line for a save the full disk refused (the run goes on)."""
    kept = mgr.latest()
    return (
        f"{error}: the checkpoint of step {step} was not saved "
        f"({f'the newest is still {kept}' if kept else 'none saved yet'}); the run goes on and the next save tries "
        "again. Free space there or pass another --ckpt_path."
    )


def foreign_checkpoint(mgr) -> Optional[Path]:
    """The newest complete checkpoint in `mgr`'s folder that another run (another run id) wrote, or None."""
    return next((p for p in mgr.complete() if read_meta(p).get("run_id") != mgr.run_id), None)


def may_save_at_stop(ctl) -> bool:
    """Whether a stop saves: always at --stop_after_steps; at a stop signal not before the first step of this
    invocation (nothing new), nor into a --ckpt_path holding another run's checkpoints (a run that saves nothing
    otherwise was not refused such a folder at its start, launch/run.py find_checkpoint; said in one line)."""
    if ctl.stop_signal is None:
        return True
    if ctl.step_index == ctl.first_step:
        return False
    other = foreign_checkpoint(ctl.checkpoints)
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


def restore_run(ctl, path: Path) -> None:
    """Load what save_run wrote into the (init()-ed) groups and the controller."""
    for call in [g.call(DeepSpeedWorker.load_checkpoint, str(path / role)) for role, g in ctl.m.trained()]:
        call.get()
    state = load_controller_state(path)
    ctl.step_index, ctl.weight_version = state["step_index"], state["weight_version"]
    ctl.loader.load_state_dict(state["loader"])
    ctl.kl_ctl.load_state_dict(state["kl_ctl"])
    if ctl.scorer.reward_norm is not None:
        ctl.scorer.reward_norm.load_state_dict(state["reward_norm"])
    set_rng_state(state["rng"])
    if ctl.evaluator is not None:
        ctl.evaluator.best = state.get("best_eval")
    ctl.restarts.count = state.get("engine_restarts", 0)


class CheckpointSteps:
    """The Controller's checkpoint steps, in their call order (the folder format is storage/checkpoint.py's): stop
    on a step boundary (--stop_after_steps, a signal) and save there, save every --save_steps, resume. Mixed into
    trainer/controller.py's Controller, whose state (step_index, checkpoints, m, ...) they read."""

    def should_stop(self) -> bool:
        """--stop_after_steps: end this invocation early, on a step boundary, keeping the full run's schedule."""
        n = self.cfg.runtime.stop_after_steps
        return self.stop_signal is not None or (n is not None and self.step_index - self.first_step >= n)

    def save_at_stop(self) -> None:
        """--stop_after_steps or a stop signal ended this invocation: save where it stopped (unless that step is
        saved already), so the later --load_checkpoint continues from here, not from the last --save_steps multiple
        (a signal's exceptions: run_state.may_save_at_stop)."""
        if self.checkpoints is not None and self._saved_step != self.step_index and may_save_at_stop(self):
            self.save_checkpoint()

    def save_checkpoint(self, mgr=None) -> Optional[Path]:
        """Every trained group's DeepSpeed state + the controller's, into a temp folder renamed into place. Returns
        its folder, or None when the disk was full: the run goes on, the newest good checkpoint stays, the next save
        tries again (said in one line)."""
        t0, mgr = time.perf_counter(), mgr or self.checkpoints
        try:
            path = save_run(self, mgr)
        except NoSpaceError as e:
            log.warning("%s", skipped_save(e, mgr, self.step_index))
            return None
        if mgr is self.checkpoints:  # the best-eval copy is not the rotation's save of this step
            self._saved_step = self.step_index
        log.info("checkpoint %s (%.1f s)", path, time.perf_counter() - t0)
        return path

    def resume(self, path) -> None:
        """Load a checkpoint written by save_checkpoint (groups already init()-ed), then re-sync the engines,
        which still hold the initial weights, before the first generation."""
        restore_run(self, path)
        self.first_step = self._saved_step = self.step_index
        self.m.rollout.load_weights(self.weight_version)
        log.info("resumed from %s at step %d (weight version %d)", path, self.step_index, self.weight_version)
