"""Before Ray starts, what a run will write against the free space of --save_path and --ckpt_path
(storage/disk_space.py's run_disk_needs and check_disk_space): one line, a warning when a filesystem lacks the space
for all of it; a refusal naming --ignore_disk_space where the final model, or one checkpoint, cannot fit at all.
The filesystems' free space is the one thing faked (shutil.disk_usage, and which filesystem a folder is on)."""

import logging
from collections import namedtuple
from pathlib import Path

import pytest

import orlhf.storage.disk_space as disk_space
from orlhf.cli import run_reporting_errors
from orlhf.config.resolve import finish_config
from orlhf.demo.builder import ensure_demo
from orlhf.storage.disk_space import (
    LOG_BYTES,
    DiskSpaceError,
    check_disk_space,
    human_bytes,
    model_numel,
    run_disk_needs,
)

Usage = namedtuple("Usage", "total used free")
MODEL_BYTES = 4 * model_numel(str(ensure_demo().model))  # the demo trains in fp32
# one checkpoint of the demo: actor and critic (one model size), each its weights, fp32 masters and Adam's two moments
CHECKPOINT_BYTES = 2 * (MODEL_BYTES + 3 * MODEL_BYTES)


@pytest.fixture
def free(monkeypatch):
    """free[folder name] = bytes free on the filesystem of that folder of the run (each its own filesystem)."""
    space: dict[str, int] = {}

    def owner(path) -> str:
        return next((name for name in space if name in Path(path).parts), "other")

    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: Usage(0, 0, space.get(owner(p), 10 * 1024**4)))
    monkeypatch.setattr(disk_space, "_filesystem", owner)
    return space


def config(tmp_path, **flags):
    """A demo run's config; its folders made (free space is asked of the nearest folder that exists)."""
    flags = {"save_path": str(tmp_path / "run"), "device": "cpu", **flags}
    for folder in (flags["save_path"], flags.get("ckpt_path")):
        Path(folder or tmp_path).mkdir(parents=True, exist_ok=True)
    return finish_config(flags, set(flags))


def disk_line(caplog, cfg) -> logging.LogRecord:
    with caplog.at_level(logging.INFO, logger="orlhf"):
        check_disk_space(cfg)
    [line] = [r for r in caplog.records if r.getMessage().startswith("disk: ")]
    return line


def test_the_final_model_the_logs_and_the_checkpoints_kept_are_counted(tmp_path, free):
    assert MODEL_BYTES > 2 * 1024**2  # the demo model: ~2.3 MB of fp32 weights
    [need] = run_disk_needs(config(tmp_path))
    assert need.parts == {"final model": MODEL_BYTES, "logs": LOG_BYTES}  # no --save_steps: no checkpoint
    cfg = config(tmp_path, save_steps=10, save_hf_ckpt=True)
    [need] = run_disk_needs(cfg)
    # each: per trained role (the demo trains actor and critic, one model size) its weights, fp32 master copy and
    # Adam's two moments (12 bytes a parameter), and the HF actor; 3 kept + 1 written before the oldest goes
    assert cfg.has_critic and need.parts["4 checkpoints"] == 4 * (2 * (MODEL_BYTES + 3 * MODEL_BYTES) + MODEL_BYTES)
    (tmp_path / "run" / "checkpoints_ppo" / "step_000010").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints_ppo" / "step_000020").mkdir()
    [need] = run_disk_needs(config(tmp_path, save_steps=10, save_hf_ckpt=True))
    assert "2 checkpoints" in need.parts  # a resumed run's own checkpoints are already there
    [need] = run_disk_needs(config(tmp_path / "stop", stop_after_steps=5))
    assert "1 checkpoint" in need.parts  # the one saved at the stop


def test_a_disk_without_room_for_the_final_model_refuses_the_run_before_it_starts(tmp_path, free):
    free["run"] = 976 * 1024
    with pytest.raises(DiskSpaceError) as refused:
        check_disk_space(config(tmp_path))
    assert str(refused.value) == (
        f"not enough disk space: {tmp_path / 'run'} (--save_path) has 976.0 KiB free and the final model needs "
        f"{human_bytes(MODEL_BYTES)}, so its export would fail at the end, after all the training. Free space there, "
        "give --save_path on a larger disk, or pass --ignore_disk_space to start anyway."
    )


def test_the_refusal_is_one_error_line_and_exit_code_1(tmp_path, free, capsys):
    free["run"] = 976 * 1024
    assert run_reporting_errors(check_disk_space, config(tmp_path)) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: not enough disk space: ") and line.endswith("--ignore_disk_space to start anyway.")


def test_ignore_disk_space_turns_the_refusal_into_the_warning_line(tmp_path, free, caplog):
    free["run"] = 976 * 1024
    line = disk_line(caplog, config(tmp_path, ignore_disk_space=True))
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"disk: {tmp_path / 'run'} has 976.0 KiB free for up to {human_bytes(MODEL_BYTES + LOG_BYTES)} (final model "
        f"{human_bytes(MODEL_BYTES)}, logs 64.0 MiB): not enough for all of it (the final model may not fit at the end)"
    )


def test_room_for_the_final_model_but_not_the_logs_too_is_a_warning(tmp_path, free, caplog):
    free["run"] = MODEL_BYTES + 1024**2  # the final model fits; the 64 MiB counted for logs may not
    line = disk_line(caplog, config(tmp_path))
    assert line.levelno == logging.WARNING and line.getMessage().endswith("(the final model may not fit at the end)")


def test_a_checkpoint_larger_than_its_disk_refuses_the_run(tmp_path, free):
    free["ck"] = 1024**2
    with pytest.raises(DiskSpaceError) as refused:
        check_disk_space(config(tmp_path, save_steps=5, ckpt_path=str(tmp_path / "ck")))
    assert str(refused.value) == (
        f"not enough disk space: {tmp_path / 'ck'} (--ckpt_path) has 1.0 MiB free and one checkpoint needs "
        f"{human_bytes(CHECKPOINT_BYTES)}, so every checkpoint the run saves would fail. Free space there, give "
        "--ckpt_path on a larger disk, or pass --ignore_disk_space to start anyway."
    )
    check_disk_space(config(tmp_path, ckpt_path=str(tmp_path / "ck")))  # saves none: nothing it must write there


def test_both_folders_short_are_one_refusal_naming_both(tmp_path, free):
    free["run"], free["ck"] = 1024, 1024
    with pytest.raises(DiskSpaceError) as refused:
        check_disk_space(config(tmp_path, stop_after_steps=2, ckpt_path=str(tmp_path / "ck")))
    message = str(refused.value)
    assert "(--save_path) has 1.0 KiB free and the final model needs" in message
    assert "; " + f"{tmp_path / 'ck'} (--ckpt_path) has 1.0 KiB free and one checkpoint needs" in message
    assert "give --save_path / --ckpt_path on a larger disk" in message and "\n" not in message


def test_checkpoints_on_a_disk_of_their_own_with_room_for_one_only_are_a_warning(tmp_path, free, caplog):
    free["ck"] = CHECKPOINT_BYTES + 1024  # one fits, the 4 held at once do not
    line = disk_line(caplog, config(tmp_path, save_steps=5, ckpt_path=str(tmp_path / "ck")))
    assert line.levelno == logging.WARNING and f"; {tmp_path / 'ck'} has " in line.getMessage()
    assert line.getMessage().endswith("(a save that finds the disk full is skipped)")


def test_enough_room_is_one_info_line(tmp_path, free, caplog):
    line = disk_line(caplog, config(tmp_path, save_steps=5))
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith(f"disk: {tmp_path / 'run'} has 10240.0 GiB free for up to ")
    assert "final model" in line.getMessage() and "4 checkpoints" in line.getMessage()
