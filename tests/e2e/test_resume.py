"""Checkpoint and resume in async mode (--async_train): 2 steps, stop, resume to 6 == an uninterrupted 6-step run
(metrics and weights); a checkpoint written under other flags is refused.

Everything is seeded: vLLM samples with per-request seeds from (seed, step), training shuffles from (seed,
step), DeepSpeed restores parameters, Adam moments, LR schedule and step counters exactly, and the engines are
re-synced from the restored actor before the first generation. Async mode generates batch k+1 with the weights
before step k's sync (trainer/async_producer.py: fixed by the order of the calls), and the checkpoint keeps the batch
generated ahead, which the resumed run trains instead of generating it again with newer weights. So equality is
exact, not approximate. (Sync mode's resume is the same path without the batch ahead: tests/e2e/test_faults.py
restarts a sync run from its checkpoint and compares it with an undisturbed one.)
"""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
# 6 steps of 64 prompts, generation one batch ahead of training
FLAGS = ["--device", "cpu", "--max_samples", "128", "--num_episodes", "3", "--save_steps", "3", "--async_train"]
COMPARED = [
    "staleness",
    "generation_weight_version",
    "reward_mean",
    "kl",
    "policy_loss",
    "value_loss",
    "approx_kl",
    "clip_frac",
    "response_length",
    "weight_version",
    "actor_lr",
]


def run(*flags: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", *FLAGS, *flags])
    return exit_.value.code


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def meta(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())


def test_resume_equals_uninterrupted_run_and_other_flags_are_refused(ray_local, tmp_path, capsys):
    """One interrupted run serves both points (each run costs a whole start-up): the refusals fail before Ray
    starts, and the resume after them must still equal the uninterrupted run (a refused run touches nothing)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run("--save_path", str(a), "--ckpt_path", str(a / "ckpt")) == 0
    assert (a / "ckpt" / "step_000006").is_dir()  # an explicit --ckpt_path is used
    # --stop_after_steps 2 saves at the stop (2 is no multiple of --save_steps 3); checkpoints default under
    # --save_path and record the run id
    assert run("--save_path", str(b), "--stop_after_steps", "2") == 0
    assert [r["step"] for r in rows(b)] == [1, 2]
    ckpt = b / "checkpoints_ppo" / "step_000002"
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [".orlhf.lock", "step_000002"]
    assert meta(ckpt)["step"] == 2 and len(meta(ckpt)["run_id"]) == 12
    (ahead,) = json.loads((ckpt / "controller.json").read_text())["pending"]  # step 3's batch, generated
    assert len(ahead["rollouts"]["rows"]) % 64 == 0 and ahead["rollouts"]["rows"]  # all its samples
    capsys.readouterr()
    code = run(
        "--save_path",
        str(b),
        "--load_checkpoint",
        "--rollout_batch_size",
        "32",
        "--train_batch_size",
        "32",
        "--temperature",
        "0.7",
    )
    err = capsys.readouterr().err
    assert code == 1 and "step_000002" in err, err
    for line in (
        "--rollout_batch_size: checkpoint 64, this run 32",
        "--train_batch_size: checkpoint 64, this run 32",
        "--temperature: checkpoint 1.0, this run 0.7",
    ):
        assert line in err, err
    # a fresh run must not mix with old checkpoints either
    assert run("--save_path", str(b)) == 1
    # a crash after the checkpoint: steps 3 and 4 were logged (the last line torn), then trained again on resume
    with open(b / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**rows(b)[-1], "step": 3}) + "\n" + '{"step": 4, "reward_me')
    assert run("--save_path", str(b), "--load_checkpoint") == 0

    full, resumed = rows(a), rows(b)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(full, resumed):
        for key in COMPARED:
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    wa, wb = load_file(a / "actor" / "model.safetensors"), load_file(b / "actor" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa), "final weights differ"
