"""metrics.jsonl, reward.png, and the wandb (offline) / TensorBoard sinks."""

import json

from orlhf.storage.metrics import MetricsLogger, read_metrics


def test_jsonl_png_wandb_offline_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    m = MetricsLogger(str(tmp_path), use_wandb="", wandb_run_name="t", use_tensorboard="", config={"a": 1})
    for step in range(1, 6):
        m.log(step, {"reward_mean": 0.1 * step, "kl": float("nan"), "timing/generate": 0.5})
    png = m.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["kl"] is None  # NaN is written as null, never as invalid JSON
    assert png.stat().st_size > 1000
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_resume_appends_and_fresh_run_truncates(tmp_path):
    m = MetricsLogger(str(tmp_path))
    m.log(1, {"reward_mean": 1.0})
    m.close()
    m = MetricsLogger(str(tmp_path), resume=True)
    m.log(2, {"reward_mean": 2.0})
    m.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    m = MetricsLogger(str(tmp_path))
    m.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_resume_cuts_the_steps_after_the_checkpoint_and_torn_lines(tmp_path):
    # a crashed run logged steps 1..5 (the last line torn mid-write); its newest checkpoint is step 3
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward_mean": s}) + "\n" for s in range(1, 5)) + '{"step": 5, "rew')
    m = MetricsLogger(str(tmp_path), resume_step=3)
    for step in (4, 5, 6):
        m.log(step, {"reward_mean": 10.0 * step})
    assert m.close(plot=False) is None
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # not 1,2,3,4,5,4,5,6
    assert rows[3]["reward_mean"] == 40.0
    assert not list(tmp_path.glob(".metrics.jsonl.trim-*"))  # the temp file was renamed over the original


def test_a_torn_metrics_file_still_plots_and_a_plot_failure_is_not_raised(tmp_path, monkeypatch, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.7}\n{"step": 3, "re')
    m = MetricsLogger(str(tmp_path), resume=True)
    png = m.close()
    assert png is not None and png.stat().st_size > 1000
    import orlhf.storage.metrics as metrics_mod

    def broken(*_a, **_k):
        raise OSError("No space left on device")

    monkeypatch.setattr(metrics_mod, "plot_rewards", broken)
    assert MetricsLogger(str(tmp_path), resume=True).close() is None
    assert "reward curve not drawn (OSError: No space left on device)" in caplog.text


def test_tensorboard_resume_has_no_duplicate_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(str(tmp_path), use_tensorboard="")
    for step in range(1, 6):
        m.log(step, {"reward_mean": float(step)})
    m.close(plot=False)
    m = MetricsLogger(str(tmp_path), use_tensorboard="", resume_step=3)  # crash after 5, checkpoint at 3
    for step in (4, 5, 6):
        m.log(step, {"reward_mean": 100.0 + step})
    m.close(plot=False)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("reward_mean")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events][3:] == [104.0, 105.0, 106.0]


def test_wandb_resumes_the_same_run_id_and_never_gets_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    import wandb

    seen = []
    real_init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.append(kw) or real_init(**kw))
    m = MetricsLogger(
        str(tmp_path), use_wandb="", run_id="abc123def456", config={"use_wandb": "<redacted>"}, resume_step=2
    )
    m.close(plot=False)
    assert seen[0]["id"] == "abc123def456" and seen[0]["resume"] == "allow"
    assert list((tmp_path / "wandb").glob("offline-run-*-abc123def456"))


def test_the_wandb_key_never_reaches_wandb_files(tmp_path, monkeypatch):
    """--use_wandb KEY: the key is neither in the config W&B stores nor in its copy of the command line."""
    import sys

    from orlhf.config.flags import build_config
    from orlhf.config.redact import public_config

    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(sys, "argv", ["orlhf", "train-ppo", "--use_wandb", key, "--use-wandb=" + key])
    cfg = build_config({"use_wandb": key, "save_path": str(tmp_path)}, {"use_wandb", "save_path"})
    config = public_config(cfg)
    assert config["logging"]["use_wandb"] == "<redacted>" and key not in json.dumps(config)
    m = MetricsLogger(str(tmp_path), use_wandb=key, config=config)
    m.log(1, {"reward_mean": 1.0})
    m.close(plot=False)
    assert sys.argv[3] == key  # restored for the rest of the process
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert files and not [p for p in files if key.encode() in p.read_bytes()]
