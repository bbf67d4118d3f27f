"""`orlhf train-ppo` end to end on the built-in demo: real Ray, DeepSpeed, vLLM; the reward must rise.

The runs share the session's Ray cluster (the CLI joins a running one). Criterion (shortened for CI): mean
reward of the last 10 steps >= 1.5 x the mean of the first 10.

Each run costs a whole start-up, so one run proves several points: the GAE run is also the
hybrid layout (--colocate_all_models) and the terminal test's run. The DAPO-style GSPO run (group_norm without a
critic, clip-higher, dynamic filtering, the overlong penalty) is test_trainer_rollout.py's learning run.
Elsewhere: the async staleness bound in test_agent.py (its multi-turn run is async), a reward model scoring in
test_openrlhf_formats.py (and the HF sequence-classification head in tests/workers).
"""

import json
from pathlib import Path

import pytest

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
REQUIRED = {
    "step",
    "reward_mean",
    "kl",
    "policy_loss",
    "samples_per_s",
    "weight_version",
    "timing/generate",
    "timing/score",
    "timing/make_experience",
    "timing/train",
    "timing/sync",
}


def train(tmp_path: Path, *flags: str) -> list[dict]:
    save = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--save_path", str(save), "--device", "cpu", *flags])
    assert exit_.value.code == 0
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert (save / "reward.png").stat().st_size > 1000
    assert (save / "actor" / "config.json").exists()
    return rows


def rise(rows: list[dict], k: int = 10) -> float:
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    return last / first


def test_gae_with_critic_learns_with_all_models_colocated(demo_cli_run):
    """The demo's default (GAE, critic, reference) in the hybrid layout: actor, critic, reference and engine on
    the same bundles, engine and trainers asked to sleep between phases. The run is the session's demo run
    (tests/e2e/conftest.py), whose terminal test_terminal.py checks."""
    res, save = demo_cli_run
    assert res.returncode == 0, res.stderr[-3000:]
    assert (res.stdout + res.stderr).count("do nothing on CPU") == 1  # said once, not silently ignored
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert (save / "reward.png").stat().st_size > 1000
    assert (save / "actor" / "config.json").exists()
    assert len(rows) == 40
    assert REQUIRED | {"value_loss"} <= set(rows[0]), set(rows[0])
    assert [r["weight_version"] for r in rows] == list(range(1, 41))
    assert rise(rows) >= 1.5, [round(r["reward_mean"], 3) for r in rows]
