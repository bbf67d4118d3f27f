"""A full disk at a checkpoint or at the final export: the run keeps its last good checkpoint and its trained weights,
and says "no space left on <path>" in one line.

Stand-ins for the rank groups (the save's call order and clean-up are pure driver logic); the error they raise is
what the driver really gets: a RankError carrying the rank's traceback as text, with torch's own writer error made
real under a file-size limit (torch hides the errno; only the free space tells it was the disk). The filesystem's
free space is the one thing faked (shutil.disk_usage), as a full disk cannot be made here without root.
"""

import errno
import logging
import resource
import signal
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import orlhf.storage.disk_space as disk_space
from orlhf.config.flags import build_config
from orlhf.distributed.groups import RankError
from orlhf.launch.export import ExportError
from orlhf.launch.run import finish_run
from orlhf.storage.checkpoint import CheckpointManager
from orlhf.storage.disk_space import NoSpaceError, no_space_error
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from tests.unit.rollout_stand_in import StandInRollout

Usage = namedtuple("Usage", "total used free")


def torch_write_error(tmp_path: Path) -> RuntimeError:
    """What torch.save raises when its file cannot grow: "[enforce fail at inline_container.cc:...]", no errno."""
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        torch.save(torch.zeros(100_000), tmp_path / "big.pt")
    except RuntimeError as e:
        return e
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    raise AssertionError("torch.save did not fail")


@pytest.fixture
def disk(monkeypatch):
    """disk["free"]: the bytes the filesystem reports free (shutil.disk_usage as disk_space sees it)."""
    state = {"free": 10 * 1024**3}
    monkeypatch.setattr(
        disk_space.shutil, "disk_usage", lambda p: Usage(2 * state["free"], state["free"], state["free"])
    )
    return state


class Failed:
    def __init__(self, error):
        self.error = error

    def get(self):
        raise self.error


class Done:
    def get(self):
        return None


class Group:
    """A one-rank group whose saves write a file; a method named in `failing` writes part of it, then fails with
    that error text (as a rank's traceback reaches the driver)."""

    world_size = 1

    def __init__(self, role):
        self.role, self.failing = role, {}

    def call(self, method, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "rng_rank0.json").write_text("{}")
        if method.__name__ in self.failing:
            (Path(path) / "partial.bin").write_bytes(b"x" * 100)
            return Failed(RankError(self.role, 0, method.__name__, self.failing[method.__name__]))
        return Done()


class Loader:
    steps_per_episode, total_steps = 10, 10

    def state_dict(self):
        return {"episode": 0, "batch_in_episode": 0}


def make(tmp_path, **flags):
    cfg = build_config({"save_path": str(tmp_path / "run"), **flags}, set(flags))
    models = Models(actor=Group("actor"), critic=Group("critic"), ref=None, rollout=StandInRollout())
    mgr = CheckpointManager(tmp_path / "ck", 3, run_id="r")
    return cfg, Controller(cfg, models, Loader(), tokenizer=None, metrics=None, checkpoints=mgr)


def test_a_full_disk_skips_the_save_and_the_next_save_step_tries_again(tmp_path, disk, caplog):
    cfg, ctl = make(tmp_path)
    ctl.step_index = 2
    good = ctl.save_checkpoint()
    ctl.step_index, disk["free"] = 4, 1024**2  # the disk fills: torch's writer fails on the actor's rank
    ctl.m.actor.failing["save_checkpoint"] = (
        f"Traceback (most recent call last):\nRuntimeError: {torch_write_error(tmp_path)}"
    )
    with caplog.at_level(logging.WARNING):
        assert ctl.save_checkpoint() is None  # no exception: the run goes on
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith(f"no space left on {tmp_path / 'ck'}") and "1.0 MiB free" in line
    assert "step 4 was not saved" in line and f"the newest is still {good}" in line and "\n" not in line
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".tmp")] == []  # its partial folder
    assert ctl.checkpoints.latest() == good  # the last good checkpoint, untouched
    ctl.step_index, disk["free"], ctl.m.actor.failing = 6, 10 * 1024**3, {}  # space again: the next save step saves
    assert ctl.save_checkpoint().name == "step_000006"
    ctl.step_index = 7
    ctl.save_at_stop()  # the stop saves its own step (nothing skipped here any more)
    assert ctl.checkpoints.latest().name == "step_000007"


def test_a_full_disk_at_the_last_save_says_the_run_ends_without_it(tmp_path, disk, caplog):
    """--stop_after_steps 3 with --save_steps 2 and a full disk at step 3: the line said "the next save tries again"
    where none comes, and the run's "done:" line did not say its last checkpoint was missing."""
    from types import SimpleNamespace

    cfg, ctl = make(tmp_path, stop_after_steps=3)
    ctl.step_index = 2
    good = ctl.save_checkpoint()
    ctl.step_index, disk["free"] = 3, 1024**2
    ctl.m.actor.failing["save_checkpoint"] = "OSError: [Errno 28] No space left on device"
    with caplog.at_level(logging.WARNING):
        ctl.save_at_stop()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "the next save tries again" not in line
    assert (
        f"the checkpoint of step 3 was not saved (the newest is still {good}); it was this run's last save, so the run "
        f"ends without it and --load_checkpoint continues from {good}." in line
    )
    ctl.m.actor.failing = {}
    metrics = SimpleNamespace(plot=lambda: None, path=tmp_path / "run" / "metrics.jsonl")
    with caplog.at_level(logging.INFO):
        finish_run(cfg, ctl.m, metrics, [], "r", ctl)
    (done,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]
    assert done.endswith(f"; no checkpoint of step 3 (the disk was full): --load_checkpoint continues from {good}")


def test_other_save_failures_still_stop_the_run_and_leave_no_temp_folder(tmp_path, disk):
    _, ctl = make(tmp_path)
    ctl.step_index = 2
    ctl.m.critic.failing["save_checkpoint"] = "PermissionError: [Errno 13] Permission denied: 'critic/global_step2'"
    with pytest.raises(RankError, match="Permission denied"):
        ctl.save_checkpoint()
    assert list((tmp_path / "ck").iterdir()) == []  # its temp folder removed, once the actor's save returned too


def test_what_counts_as_a_full_disk(tmp_path, disk):
    full = OSError(errno.ENOSPC, "No space left on device")
    chained = RuntimeError("writing failed")
    chained.__context__ = full
    assert isinstance(no_space_error(chained, tmp_path), NoSpaceError)  # an ENOSPC anywhere in the chain
    ray_text = RankError("actor", 0, "save_hf", "OSError: [Errno 28] No space left on device: 'model.safetensors'")
    assert no_space_error(ray_text, tmp_path) is not None  # a rank's traceback, as text
    torch_error = torch_write_error(tmp_path)
    assert no_space_error(torch_error, tmp_path) is None  # torch's bare writer error, with room on the disk
    disk["free"] = 0
    err = no_space_error(torch_error, tmp_path / "not" / "made")  # ... and on a full one (nearest existing parent)
    assert str(err) == f"no space left on {tmp_path / 'not' / 'made'} (0 B free)" and err.errno == errno.ENOSPC


def test_a_full_save_path_keeps_the_trained_actor_in_a_checkpoint(tmp_path, disk):
    """The default run saves no checkpoint: without one, a failed export lost the trained actor."""
    cfg, ctl = make(tmp_path)
    ctl.step_index = 8
    (tmp_path / "run" / "actor").mkdir(parents=True)
    (tmp_path / "run" / "actor" / "old.safetensors").write_text("the previous export")
    ctl.m.actor.failing["save_hf"] = "OSError: [Errno 28] No space left on device"  # --ckpt_path has room
    with pytest.raises(ExportError) as e:
        finish_run(cfg, ctl.m, None, [], "r", ctl)
    msg = str(e.value)
    assert msg.startswith(f"could not export to {tmp_path / 'run' / 'actor'}: no space left on ")
    assert f"kept in the checkpoint {tmp_path / 'ck' / 'step_000008'}" in msg
    assert f"--load_checkpoint --ckpt_path {tmp_path / 'ck'}" in msg and "\n" not in msg
    assert ctl.checkpoints.latest().name == "step_000008"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["actor"]  # no temp export left behind
    assert (tmp_path / "run" / "actor" / "old.safetensors").read_text() == "the previous export"


def test_when_nothing_can_be_written_the_line_says_so(tmp_path, disk):
    cfg, ctl = make(tmp_path)
    ctl.step_index, disk["free"] = 8, 0
    for method in ("save_hf", "save_checkpoint"):
        ctl.m.actor.failing[method] = "RuntimeError: [enforce fail at inline_container.cc:672] . file write failed"
    with pytest.raises(ExportError) as e:
        finish_run(cfg, ctl.m, None, [], "r", ctl)
    msg = str(e.value)
    assert f"nor save a checkpoint instead (no space left on {tmp_path / 'ck'} (0 B free))" in msg
    assert "Nothing kept the trained weights" in msg and "\n" not in msg
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())


def test_with_both_run_disks_full_the_actor_is_kept_on_another_disk(tmp_path, disk, monkeypatch):
    """The export and the checkpoint fail for lack of space: the HF actor (the export itself) goes to the system's
    temp folder when that is another filesystem, and the line says where."""
    import tempfile

    cfg, ctl = make(tmp_path)
    ctl.step_index, disk["free"] = 8, 0
    other = tmp_path / "other"
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(other))
    monkeypatch.setattr(disk_space, "_filesystem", lambda p: "other" if "other" in Path(p).parts else "run's")

    class RunDisksFull(Group):  # the writes on the run's filesystem fail, the others do not
        def call(self, method, path):
            failing, self.failing = self.failing, ({} if "other" in Path(path).parts else self.failing)
            try:
                return super().call(method, path)
            finally:
                self.failing = failing

    ctl.m.actor.__class__ = RunDisksFull
    for method in ("save_hf", "save_checkpoint"):
        ctl.m.actor.failing[method] = "OSError: [Errno 28] No space left on device"
    with pytest.raises(ExportError) as e:
        finish_run(cfg, ctl.m, None, [], "r", ctl)
    kept = other / "orlhf-r-step_000008" / "actor"
    msg = str(e.value)
    assert f"The trained actor of step 8 is kept as an HF folder on another disk, {kept}: it is the export" in msg
    assert (kept / "rng_rank0.json").exists() and "\n" not in str(e.value)
