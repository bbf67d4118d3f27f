"""Faults in a real run (a subprocess with its own local Ray): a killed rank, a killed engine, Ctrl-C, SIGTERM, a
diverged update.

Each must stop the run within 60 s with a line naming what happened, and leave no process behind: every
descendant of the run (raylet, GCS, rank actors, engines) is recorded while it runs and must be gone after.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
ORLHF = str(Path(sys.executable).parent / "orlhf")


def _default_sigint() -> None:
    # As from a terminal. A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT as
    # ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C would rightly do nothing.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "run.log"
    proc = subprocess.Popen(
        [ORLHF, "train-ppo", "--num_episodes", "50", "--device", "cpu", "--save_path", str(tmp_path / "run")],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    return proc, log


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 240) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in the log within {timeout} s:\n{log.read_text()[-3000:]}")


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def assert_stops_clean(proc: subprocess.Popen, tree: list[psutil.Process], t0: float, log: Path) -> str:
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    text = log.read_text()
    assert elapsed < 60, f"the run took {elapsed:.0f} s to stop:\n{text[-3000:]}"
    deadline = time.monotonic() + 20
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    return text


def first_step_logged(tmp_path: Path, proc, log) -> None:
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.parametrize(
    "pid_line, error",
    [
        # the reference and the demo's critic run in the actor's process (CPU): their calls may be the ones that meet
        # the death first
        (
            r"actor: 1 rank\(s\), pids \[(\d+)\]",
            r"error: (actor rank 0 failed in \w+\(\)|"
            r"(ref|critic) rank 0 failed in \w+\(\) \(in actor rank 0's process\))",
        ),
        (r"vllm engines: 1, pids \[(\d+)\]", r"error: (vllm engine|weight sync).* 0 failed"),
    ],
    ids=["actor_rank", "vllm_engine"],
)
def test_killed_process_stops_the_run_naming_it(tmp_path, pid_line, error):
    proc, log = start_run(tmp_path)
    pid = int(wait_for(log, pid_line, proc).group(1))
    first_step_logged(tmp_path, proc, log)
    tree = descendants(proc)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    text = assert_stops_clean(proc, tree, t0, log)
    assert proc.returncode == 1
    assert re.search(error, text), text[-2000:]


def test_a_signal_saves_the_step_and_stops_cleanly(tmp_path):
    """A scheduler's SIGTERM (before: Ray's C++ stack dump, no checkpoint, no orlhf line), handled as Ctrl-C is
    (launch/stop_signals.py; tests/unit/test_stop_signals.py for SIGINT): the step in progress ends, is saved, and
    one line says what was kept and how to resume."""
    sig = signal.SIGTERM
    proc, log = start_run(tmp_path)
    first_step_logged(tmp_path, proc, log)
    tree = descendants(proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    text = assert_stops_clean(proc, tree, t0, log)
    assert proc.returncode == 128 + sig, text[-2000:]
    m = re.search(
        rf"interrupted by {sig.name} after step (\d+): checkpoint (\S+) kept; run the same command with "
        r"--load_checkpoint to continue from it",
        text,
    )
    assert m, text[-2000:]
    assert Path(m.group(2)).name == f"step_{int(m.group(1)):06d}" and (Path(m.group(2)) / "meta.json").exists()


def test_a_diverged_run_stops_before_its_weights_go_anywhere(tmp_path):
    """--actor_learning_rate 1e30: losses, KL and the engine gap went NaN from step 2, metrics.jsonl wrote null,
    and the run ended rc 0 exporting weights of ~5e29. Now step 2 stops it with one line, and nothing is exported."""
    save = tmp_path / "run"
    res = subprocess.run(
        [
            ORLHF,
            "train-ppo",
            "--device",
            "cpu",
            "--num_episodes",
            "1",
            "--actor_learning_rate",
            "1e30",
            "--save_steps",
            "1",
            "--vllm_num_engines",
            "0",  # the check is the driver's: the actor's ranks generate, no engine start-up to wait for
            "--save_path",
            str(save),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1, res.stderr[-3000:]
    assert re.fullmatch(
        r"error: step 2: .*nan.* the updates diverged, so the run stops before these weights reach "
        r"the engines, a checkpoint or the export\. Train again with a lower --actor_learning_rate "
        r"\(now 1e\+30\)\.",
        last,
    ), res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not (save / "actor").exists()
    saved = sorted(p.name for p in (save / "checkpoints_ppo").glob("step_*"))
    assert saved == ["step_000001"]  # step 1's, whose numbers were finite; never step 2's
