"""Multi-turn agents and evaluation end to end: real Ray, DeepSpeed and vLLM on the built-in demo.

- The built-in multi-turn environment (orlhf/demo/agent.py, 3 turns) learns: reward of the last 10 steps >= 1.5x
  the first 10, with --async_train (--async_queue_size 2: each step trains on rollouts at most 2 versions old,
  and generation really overlaps training) and --partial_rollout (a sync lands between two turns; OpenRLHF's async
  agent scripts use both) and --n_samples_per_prompt 4, while evaluating every 8 steps and keeping the best
  checkpoint outside the rotation. (This run is also the suite's async check: a run costs a whole start-up.)
- Evaluation never changes the training trajectory: the same steps with and without --eval_dataset give the same
  rewards, losses and KL (gae: the critic sees the multi-turn masks too).
- A bad agent step stops the run with one message naming the agent file, the sample and the key.
"""

import json
from pathlib import Path

import pytest

import orlhf
from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
DEMO_AGENT = str(Path(orlhf.__file__).parent / "demo" / "agent.py")


def run(tmp_path: Path, name: str, *flags: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "train-ppo",
                "--save_path",
                str(tmp_path / name),
                "--ckpt_path",
                str(tmp_path / name / "ckpt"),
                "--device",
                "cpu",
                "--agent_func_path",
                DEMO_AGENT,
                "--generate_max_len",
                "8",
                *flags,
            ]
        )
    return exit_.value.code


def rows_of(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


@pytest.fixture
def eval_data(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"say colors: {w} run", "label": "colors"}) + "\n"
            for w in ("cat", "sky", "house", "tree", "red", "big", "sun", "dog")
        )
    )
    return str(path)


def test_multi_turn_demo_learns_async_with_eval_and_best_checkpoint(ray_local, tmp_path, eval_data):
    code = run(
        tmp_path,
        "mt",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--async_train",
        "--async_queue_size",
        "2",
        "--partial_rollout",
        "--num_episodes",
        "3",
        "--eval_dataset",
        eval_data,
        "--eval_steps",
        "8",
        "--best_metric_key",
        "reward_mean",
        "--save_steps",
        "8",
        "--max_ckpt_num",
        "1",
    )
    assert code == 0
    rows = rows_of(tmp_path, "mt")
    assert len(rows) == 24
    assert [r["weight_version"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:  # trained at version weight_version - 1 on rollouts of generation_weight_version
        assert r["staleness"] == r["weight_version"] - 1 - r["generation_weight_version"]
        assert 0 <= r["staleness"] <= 2
        # --partial_rollout: each action token's version is its turn's; staleness counts the oldest
        assert 0 <= r["token_staleness_mean"] <= r["token_staleness_max"] <= r["staleness"]
    assert max(r["staleness"] for r in rows) >= 1  # generation really overlapped training
    assert all(r["agent/turns"] == 3.0 for r in rows)  # every episode ran its 3 turns
    assert all(0 < r["response_length"] <= 24 for r in rows)  # model tokens only: 3 turns x <= 8
    # step 1 generates and scores with the same weights: the engine's and the trainer's log-probs of the model's
    # tokens agree, so actions and feedback are aligned token for token (later steps are one version stale)
    assert rows[0]["engine_logprob_gap"] < 2e-3
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last >= 1.5 * first, [round(r["reward_mean"], 3) for r in rows]  # async runs' criterion
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [8, 16, 24]
    assert all({"eval/pass@1", "eval/pass@4"} <= set(r) for r in evals)
    best = [p.name for p in (tmp_path / "mt" / "ckpt" / "best").iterdir() if p.name.startswith("step_")]
    assert len(best) == 1, best
    best_step = int(best[0].split("_")[1])
    assert max(evals, key=lambda r: r["eval/reward_mean"])["step"] == best_step
    rotated = sorted(p.name for p in (tmp_path / "mt" / "ckpt").iterdir() if p.name.startswith("step_"))
    assert rotated == ["step_000024"]  # --max_ckpt_num 1 kept only the newest; best/ is apart


def test_eval_does_not_change_the_training_trajectory(ray_local, tmp_path, eval_data):
    flags = ["--max_samples", "64", "--rollout_batch_size", "32", "--train_batch_size", "32", "--num_episodes", "1"]
    assert run(tmp_path, "plain", *flags) == 0
    assert run(tmp_path, "eval", *flags, "--eval_dataset", eval_data, "--eval_steps", "1") == 0
    plain, with_eval = rows_of(tmp_path, "plain"), rows_of(tmp_path, "eval")
    assert len(plain) == len(with_eval) == 2 and all("eval/reward_mean" in r for r in with_eval)
    assert all(r["engine_logprob_gap"] < 2e-3 for r in plain)  # synced weights: engine and trainer agree
    for key in ("reward_mean", "policy_loss", "value_loss", "kl", "response_length"):
        assert [r[key] for r in plain] == [r[key] for r in with_eval], key


def test_a_bad_agent_step_names_the_file_sample_and_key(ray_local, tmp_path, capsys):
    bad = tmp_path / "bad_agent.py"
    bad.write_text(
        Path(DEMO_AGENT).read_text().replace('"done": done,', '**({"done": done} if self.turn < 2 else {}),')
    )
    # reinforce without a KL: no critic and no reference to start (the error comes from the agent, not a model)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "train-ppo",
                "--save_path",
                str(tmp_path / "bad"),
                "--device",
                "cpu",
                "--agent_func_path",
                str(bad),
                "--generate_max_len",
                "8",
                "--max_samples",
                "64",
                "--num_episodes",
                "1",
                "--advantage_estimator",
                "reinforce",
                "--init_kl_coef",
                "0",
            ]
        )
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "sample 0 (prompt 0 of the batch, sample 1 of 1)" in err and "'done'" in err
