"""benchmarks/bench_train_mfu.py: its pure parts (the peak table, MFU, the kernel ranking, the doubling search) and
one run end to end on CPU with a tiny model (what scripts/gpu_check.sh runs on a GPU with 0.4B and 1B models).
Speed is measured by the benchmark, never asserted here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train_mfu as bm  # noqa: E402


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # the SXM part
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 PCIe", None),  # a lower peak the table does not hold: MFU null, not a wrong figure
        ("NVIDIA L4", None),
    ],
)
def test_peak_by_gpu_name(name, peak):
    assert bm.gpu_peak_tflops(name) == peak


def test_mfu_is_six_p_t_over_time_and_peak():
    # 1e9 params x 8192 tokens x 6 = 4.9152e13 FLOP in 0.1 s = 491.52 TFLOP/s; / 989 = 0.49699...
    assert bm.mfu(10**9, 8192, 0.1, 989.0) == pytest.approx(491.52 / 989)
    assert bm.mfu(10**9, 8192, 0.1, None) is None


def test_top_kernels_sum_launches_by_name_and_rank_by_time():
    events = [("gemm", 300.0), ("softmax", 50.0), ("gemm", 500.0), ("adam", 150.0, 3)]
    top = bm.top_kernels(events, n=2)
    assert [k["name"] for k in top] == ["gemm", "adam"]
    assert top[0] == {"name": "gemm", "calls": 2, "total_ms": 0.8, "share": 0.8}
    assert top[1]["calls"] == 3 and top[1]["share"] == pytest.approx(0.15)


def test_doubling_stops_at_the_first_oom_and_marks_the_largest_fit():
    tried = []

    def run(mb):
        tried.append(mb)
        return {"micro_batch": mb, "oom": mb >= 16}

    rows = bm.doubling(2, 1024, run)
    assert tried == [2, 4, 8, 16]
    assert [r["micro_batch"] for r in rows if r.get("largest_fit")] == [8]
    assert [r["micro_batch"] for r in bm.doubling(2, 5, lambda mb: {"micro_batch": mb})] == [2, 4]
    failed = bm.doubling(1, 64, lambda mb: {"micro_batch": mb, "error": "exit 1"} if mb == 2 else {"micro_batch": mb})
    assert [r["micro_batch"] for r in failed] == [1, 2] and failed[0]["largest_fit"]


def test_sizes_and_sets_parse_or_name_the_bad_entry():
    assert bm.parse_sizes("0.4b, 1024x8") == [("0.4b", 1536, 16), ("1024x8", 1024, 8)]
    with pytest.raises(ValueError, match="'2b'"):
        bm.parse_sizes("1b,2b")
    assert bm.parse_sets(["zero_stage=3", "--packing_samples=true", "lr_scheduler=constant"]) == {
        "zero_stage": 3,
        "packing_samples": True,
        "lr_scheduler": "constant",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bm.parse_sets(["zero_stage"])


def test_tiny_run_on_cpu_ends_with_one_json_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_train_mfu.py"), "--device", "cpu", "--sizes", "tiny"]
    cmd += ["--micro_batch", "2", "--seq_len", "32", "--warmup", "0", "--steps", "1", "--cache", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["gpu"] is None and "MFU null" in out["note"]
    (row,) = out["results"]
    for key in ("params", "tokens_per_s", "step_s", "mfu", "peak_alloc_mib", "plan_mib", "top_kernels", "zero_stage"):
        assert key in row, key
    assert row["mfu"] is None and row["peak_alloc_mib"] is None  # no peak and no CUDA allocator on a CPU
    assert row["params"] == row["plan_params"] > 0  # the plan counts the model the worker built
    assert row["tokens_per_step"] == 2 * 32 and row["tokens_per_s"] > 0
    assert row["zero_stage"] == 0 and row["plan_mib"] > 0  # one rank trains without ZeRO; the plan sized it
    assert row["top_kernels"] and all(k["total_ms"] >= 0 for k in row["top_kernels"])
