"""The controller's side of a checkpoint: what one holds beyond the model groups' own state, and how it returns.

    save_run(ctl, mgr):  tmp = mgr.begin(step) -> each trained group saves its DeepSpeed state (tmp/<role>)
        [--save_hf_ckpt / --disable_ds_ckpt: the actor as an HF folder, tmp/hf/actor] -> the controller's state
        (step, weight version, loader position, KL controller, reward normaliser, RNG, best eval score)
        -> mgr.commit (atomic rename; meta.json with the config fingerprint)
    restore_run(ctl, path): the groups load their state, then the controller's (the engines are re-synced by
        the caller)
The folder format and its atomic commit are storage/checkpoint.py's; this module only says what goes in.
"""

from __future__ import annotations

from pathlib import Path

from orlhf.config.fingerprint import config_fingerprint
from orlhf.storage.checkpoint import load_controller_state, rng_state, save_controller_state, set_rng_state
from orlhf.workers import PolicyWorker
from orlhf.workers.base import DeepSpeedWorker


def save_run(ctl, mgr) -> Path:
    """Write step ctl.step_index into `mgr` (the rotation's or the best-eval manager); returns its folder."""
    step, hf_only = ctl.step_index, ctl.cfg.logging.disable_ds_ckpt  # hf_only: no DeepSpeed state, no resume
    tmp = mgr.begin(step)
    trained = [] if hf_only else ctl.m.trained()
    for call in [g.call(DeepSpeedWorker.save_checkpoint, str(tmp / role)) for role, g in trained]:
        call.get()
    if ctl.cfg.logging.save_hf_ckpt or hf_only:  # after: both are collectives on the actor ranks, never interleaved
        ctl.m.actor.call(PolicyWorker.save_hf, str(tmp / "hf" / "actor")).get()
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
