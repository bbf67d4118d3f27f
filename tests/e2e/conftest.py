"""Fixtures of the end-to-end tests. Each run costs a whole start-up (Ray actors, DeepSpeed,
vLLM), so a run that can prove the points of several test files is started once per session, here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The demo's default (GAE with critic and reference) for 5 episodes of 8 steps, in the hybrid layout.
DEMO_RUN_FLAGS = ("--num_episodes", "5", "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep")


@pytest.fixture(scope="session")
def demo_cli_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m orlhf.cli train-ppo` on the built-in demo as a person runs it: a subprocess with its terminal
    captured (100 columns). Used by test_terminal.py (what the terminal shows) and test_train_ppo.py (GAE learns
    with all models colocated). Returns (the finished process, its --save_path)."""
    save = tmp_path_factory.mktemp("demo_cli") / "run"
    res = subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "train-ppo", "--device", "cpu", "--save_path", str(save), *DEMO_RUN_FLAGS],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "100"},
    )
    return res, save
