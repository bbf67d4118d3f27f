"""`orlhf report`: the figure and page from a run's metrics.jsonl, and its errors."""

import json

import pytest

from orlhf.cli import main
from orlhf.storage.report import PANELS, write_report


def write_metrics(folder, steps=12, **drop):
    rows = []
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "reward_mean": 0.1 + 0.01 * s,
            "kl": 0.001 * s,
            "policy_loss": -0.01,
            "value_loss": 0.2,
            "entropy": 3.0,
            "samples_per_s": 40.0,
            "staleness": s % 2,
            "engine_logprob_gap": 1e-4,
            "response_length": 20.0,
            "timing/generate": 0.4,
            "timing/train": 0.6,
        }
        rows.append({k: v for k, v in row.items() if k not in drop})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_writes_png_and_html(tmp_path):
    write_metrics(tmp_path)
    png, page = write_report(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = page.read_text()
    assert "report.png" in text and "reward_mean" in text and "step 12" in text
    assert len(PANELS) == 9


def test_an_evaluation_before_training_is_step_0_not_a_step(tmp_path):
    write_metrics(tmp_path, steps=3)
    before = {"step": 0, "eval/pass@1": 0.1, "eval/reward_mean": 0.1, "timing/eval": 2.0}
    rows = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(json.dumps(before) + "\n" + rows.replace("}\n", ', "eval/pass@1": 0.5}\n'))
    _, page = write_report(tmp_path)
    text = page.read_text()
    assert "<p>3 steps logged" in text and "step 0</th><th>step 3" in text
    assert "<td>eval/pass@1</td><td>0.1</td><td>0.5</td>" in text  # before training and after, side by side


def test_missing_metric_is_said_not_drawn_wrong(tmp_path):
    write_metrics(tmp_path, value_loss=None, entropy=None)  # a critic-free run without entropy logging
    png, _ = write_report(tmp_path)
    assert png.exists()


def test_report_command_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path)])
    assert e.value.code == 1 and "no metrics file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path)])
    assert e.value.code == 1 and "no steps" in capsys.readouterr().err
