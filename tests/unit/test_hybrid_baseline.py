"""The DeepSpeed-Chat-style baseline's own pieces (benchmarks/): it runs without Ray or vLLM (the lent GPU machines
have neither) and it refuses the flags it cannot honour (its generation is orlhf's in-trainer backend:
tests/unit/test_generation.py). The end-to-end run is tests/e2e/test_benchmarks_smoke.py."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_baseline_and_controller_import_without_ray_or_vllm():
    code = (
        "import sys; sys.modules['ray'] = None; sys.modules['vllm'] = None; "
        "sys.argv = ['x']; import runpy; "
        "g = runpy.run_path('benchmarks/hybrid_engine_baseline.py', run_name='not_main'); "
        "import orlhf.trainer.controller, hybrid_worker; print(g['Controller'].__module__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("orlhf.trainer.controller")


def test_baseline_refuses_flags_it_cannot_honour(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/hybrid_engine_baseline.py", "--async_train", "--save_path", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--async_train" in proc.stderr and "drop --async_train" in proc.stderr


def test_hybrid_engine_refused_with_transformers_5(monkeypatch):
    """DeepSpeed 0.19.8's inference kernels crash on transformers 5's decoder layers (seen on an H100): refused."""
    import importlib.metadata
    import runpy

    g = runpy.run_path(str(ROOT / "benchmarks" / "hybrid_engine_baseline.py"), run_name="not_main")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.19.0")
    assert "Drop --hybrid_engine" in g["hybrid_engine_blocker"]() and "5.19.0" in g["hybrid_engine_blocker"]()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.57.1")
    assert g["hybrid_engine_blocker"]() == ""
