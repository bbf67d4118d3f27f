"""metrics.jsonl, reward.png, and the wandb (offline) / TensorBoard sinks."""

import json

from orlhf.metrics import MetricsLogger, read_metrics


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
