"""The benchmark scripts run end to end on the demo: one ppo_throughput invocation with
`--steps 1 --warmup 1 --modes hybrid,split` runs the DeepSpeed-Chat-style baseline for 2 steps, then orlhf's
split mode, and ends with one JSON line. Both are subprocesses (the baseline owns its process group; orlhf starts
its own Ray), as a user runs them.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def throughput(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_throughput")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/ppo_throughput.py",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--modes",
            "hybrid,hybrid+padded,split",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_hybrid_baseline_runs_two_steps_with_finite_reward(throughput):
    out, _ = throughput
    rows = [json.loads(line) for line in open(out / "hybrid-r0" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["policy_loss"]) for r in rows), rows
    assert all(r["timing/generate"] > 0 and r["timing/train"] > 0 for r in rows)
    # HF generate's sampling log-probs == the actor's own forward on the same tokens: generation ran on the
    # engine's (gathered) trained weights, with the sampler's temperature.
    assert all(r["engine_logprob_gap"] < 1e-3 for r in rows), [r["engine_logprob_gap"] for r in rows]
    assert rows[1]["weight_version"] == 2


def test_ppo_throughput_ends_with_one_json_line(throughput):
    out, stdout = throughput
    result = json.loads(stdout.strip().splitlines()[-1])
    assert set(result["speedup_vs_hybrid"]) == {"hybrid", "hybrid+padded", "split"}
    assert result["speedup_vs_hybrid"]["hybrid"] == 1.0 and result["speedup_vs_hybrid"]["split"] > 0
    for mode in ("hybrid", "split"):
        r = result["modes"][mode]
        assert r["steps_measured"] == 1 and r["samples_per_s"] > 0 and r["peak_rss_total_gb"] > 0
        assert {"generate", "score", "train"} <= set(r["phases"])
        assert r["cpu_s_per_step_total"] > 0 and r["cpu_s_per_step"]["driver"] > 0
    assert "RankActor" in result["modes"]["split"]["peak_rss_gb"]
    assert "EngineActor" in result["modes"]["split"]["peak_rss_gb"]
    assert result["modes"]["split"]["cpu_s_per_step"]["RankActor"] > 0  # the trainers' processes are counted
    assert "CPU seconds per measured step" in stdout
    assert Path(result["png"]).stat().st_size > 1000


def test_knob_runs_its_base_with_the_flag_and_is_compared_to_it(throughput):
    out, stdout = throughput
    result = json.loads(stdout.strip().splitlines()[-1])
    assert set(result["knob_speedups"]) == {"hybrid+padded"} and result["knob_speedups"]["hybrid+padded"] > 0
    assert "--no_trim_padding" in (out / "hybrid+padded-r0" / "cmd.txt").read_text()
    assert "--no_trim_padding" not in (out / "hybrid-r0" / "cmd.txt").read_text()
    assert "speed-ups, each on vs off" in stdout
    # Padding changes no result: the first step (before any update) scores the same samples the same way.
    modes = result["modes"]
    assert modes["hybrid+padded"]["rewards"][0] == modes["hybrid"]["rewards"][0]


def test_unknown_knob_is_refused():
    proc = subprocess.run(
        [sys.executable, "benchmarks/ppo_throughput.py", "--modes", "hybrid,split+turbo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "split+turbo" in proc.stderr and "mb_full" in proc.stderr


def test_bench_padding_compares_three_layouts_with_equal_results(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/probes/bench_padding.py",
            "--batch",
            "8",
            "--micro",
            "4",
            "--response_len",
            "4",
            "24",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["results"]) == {"padded", "trimmed", "packed"} and 0 < result["real_token_share"] < 1
    for name, r in result["results"].items():
        assert r["log_probs_s"] > 0 and r["train_step_s"] > 0
        assert r["max_abs_diff_vs_padded"] < 1e-4, (name, r)


def test_bench_engine_step_repeats_the_same_rollouts(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/probes/bench_engine_step.py",
            "--repeats",
            "2",
            "--num_prompts",
            "8",
            "--out",
            str(tmp_path / "r.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rollouts"] == 32 and result["tokens"] > 32 and result["threads"] == 1
    assert len(result["digests"]) == 1 and len(result["cpu_s"]) == 2 and min(result["cpu_s"]) > 0


def test_bench_lora_reports_both_modes_in_fresh_processes(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_lora.py",
            "--presets",
            "demo",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "r.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "r.json").read_text())
    full, lora = result["results"]["demo"]["full"], result["results"]["demo"]["lora"]
    assert full["trainable_params"] == full["total_params"] and 0 < lora["trainable_params"] < full["total_params"]
    # Adam's two fp32 moments per trained parameter (and a step counter each)
    for r in (full, lora):
        assert 8 * r["trainable_params"] <= r["optimizer_state_bytes"] < 8 * r["trainable_params"] + 4096
    assert 0 < lora["sync_bytes"] < full["sync_bytes"] == 4 * full["total_params"]  # fp32, every weight
    assert full["train_step_s_median"] > 0 and lora["train_step_s_median"] > 0 and lora["peak_rss_kib"] > 0
    assert "LoRA / full" in proc.stdout
