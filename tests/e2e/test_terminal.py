"""What a person sees in the terminal during a real run (a subprocess with its own local Ray), and where the rest
goes: orlhf's own lines and one whole progress bar; library and rank output in <save_path>/logs; a rank's error
still on the terminal."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
BAR = re.compile(r"^ppo: +\d+%\|")


def run_cli(tmp_path: Path, *flags: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, Path]:
    save = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "train-ppo", "--device", "cpu", "--save_path", str(save), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "100"},
    )
    return res, save


def terminal_lines(text: str) -> tuple[list[str], list[str]]:
    """(lines besides the bar, bar frames). tqdm redraws its bar after a carriage return."""
    other, bar = [], []
    for line in text.split("\n"):
        for seg in line.split("\r"):
            if seg.strip():
                (bar if seg.startswith("ppo:") else other).append(seg)
    return other, bar


def test_a_demo_run_shows_only_orlhf_lines_and_a_whole_bar(demo_cli_run):
    res, save = demo_cli_run  # 40 steps of the demo in the hybrid layout (tests/e2e/conftest.py)
    assert res.returncode == 0, res.stderr[-3000:]
    other, bar = terminal_lines(res.stdout + res.stderr)
    assert len(other) <= 40, "\n".join(other)
    assert all(line.startswith("[orlhf]") for line in other), "\n".join(other)
    assert bar and all(BAR.match(frame) for frame in bar), bar  # never torn by other output
    text = "\n".join(other)
    assert str(save / "logs") in text and "reward: first" in text and "report:" in text
    logs = save / "logs"
    for name in ("driver.log", "actor-0.log", "vllm-0.log"):
        assert (logs / name).exists(), sorted(p.name for p in logs.iterdir())
    # on CPU the reference and the one-rank critic run in the actor's process (hosting_rules.host_of): no own logs
    assert not (logs / "ref-0.log").exists() and not (logs / "critic-0.log").exists()
    assert "ref: 1 rank(s) inside the actor's rank processes" in text
    assert "critic: 1 rank(s) inside the actor's rank processes, its calls beside the actor's" in text
    assert (logs / "vllm-0.log").stat().st_size > 0  # vLLM's start-up chatter went there
    assert (save / "report.png").stat().st_size > 20_000 and (save / "report.html").exists()


def test_a_rank_error_reaches_the_terminal_whole(tmp_path):
    from safetensors.torch import load_file, save_file

    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    broken = tmp_path / "broken"
    shutil.copytree(demo.model, broken)
    [weights] = broken.glob("*.safetensors")
    state = load_file(weights)
    state["lm_head.weight"] = state["lm_head.weight"].t().contiguous()  # a whole file, one tensor the wrong shape
    save_file(state, weights, metadata={"format": "pt"})
    # The driver's pre-flight reads headers and sizes only (a truncated file fails there, tests/unit/
    # test_preflight_inputs.py), so the actor rank meets the wrong shape in its init().
    res, save = run_cli(
        tmp_path,
        "--pretrain",
        str(broken),
        "--prompt_data",
        str(demo.prompts),
        "--remote_rm_url",
        str(demo.reward_fn),
        "--input_key",
        "prompt",
        "--label_key",
        "label",
        "--advantage_estimator",
        "reinforce",
        "--init_kl_coef",
        "0",
        "--prompt_max_len",
        "64",
        "--generate_max_len",
        "24",
        "--vllm_num_engines",  # no engine to start: the rank's error path is the point
        "0",
        timeout=600,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    err = res.stderr
    assert re.search(r"actor rank 0 failed in init\(\)", err), err[-3000:]
    assert re.search(r'File ".*", line \d+', err) and "mismatch" in err.lower()  # the rank's traceback frames
    assert str(save / "logs") in err
