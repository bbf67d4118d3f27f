"""Faults in a real run (a subprocess with its own local Ray): a killed rank, a killed engine, Ctrl-C, SIGTERM, a
diverged update.

Each must stop the run within 60 s with a line naming what happened, and leave no process behind: every
descendant of the run (raylet, GCS, rank actors, engines) is recorded while it runs and must be gone after. Except
a killed engine under --max_engine_restarts (default 3): it is replaced in place and the run goes on; and a killed
rank under --max_restarts (default 2): the run starts its groups again from its newest checkpoint. Both end with the
metrics of a run nothing happened to.
"""

import json
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


def start_run(
    tmp_path: Path, flags: tuple = ("--num_episodes", "50"), name: str = "run"
) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen(
        [ORLHF, "train-ppo", *flags, "--device", "cpu", "--save_path", str(tmp_path / name)],
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
    alive = [p for p in tree if running(p)]  # the driver waits for its cluster's processes before it exits
    for p in alive:
        p.kill()
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    assert "*** SIG" not in text and "PC: @" not in text  # no C++ stack dump
    return text


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def first_step_logged(tmp_path: Path, proc, log) -> None:
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.parametrize(
    "pid_line, error, flags",
    [
        # the reference and the demo's critic run in the actor's process (CPU): their calls may be the ones that meet
        # the death first
        (
            r"actor: 1 rank\(s\), pids \[(\d+)\]",
            r"error: (actor rank 0 failed in \w+\(\)|"
            r"(ref|critic) rank 0 failed in \w+\(\) \(in actor rank 0's process\))",
            (),
        )
        # a lost engine is replaced (test_a_killed_engine_is_replaced...); with --max_engine_restarts 0 it stops the
        # run by name as a rank does (tests/unit/test_engine_restart.py)
    ],
    ids=["actor_rank"],
)
def test_killed_process_stops_the_run_naming_it(tmp_path, pid_line, error, flags):
    """--max_restarts 0: a lost process stops the run (with restarts left it restarts: the test below)."""
    # no engine to start: the actor's ranks generate (the stop is the same with engines; they are the run below)
    proc, log = start_run(tmp_path, ("--num_episodes", "50", "--max_restarts", "0", "--vllm_num_engines", "0", *flags))
    pid = int(wait_for(log, pid_line, proc).group(1))
    first_step_logged(tmp_path, proc, log)
    tree = descendants(proc)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    text = assert_stops_clean(proc, tree, t0, log)
    assert proc.returncode == 1
    assert re.search(error, text), text[-2000:]
    lost = r"actor rank 0 lost during (step \d+|the checkpoint of step \d+); not restarted: --max_restarts 0"
    assert re.search(lost, text), text[-2000:]


STOP_LINE = r"\[orlhf\] stopped by SIGTERM during (the start-up|the restart after a lost process|step \d+): "


def test_sigterm_during_a_restart_stops_at_once_naming_the_checkpoint_kept(tmp_path):
    """Before: the driver exited within a second, rc 15, without a line (ray.init's own SIGTERM handler was back once
    the loop's had been taken away). A rank lost after step 2's checkpoint starts a restart; SIGTERM then stops the
    run at once, and its last line names the checkpoint it keeps and the command to continue from it."""
    flags = (*RESTART_FLAGS, "--max_restarts", "1", "--vllm_num_engines", "0")
    proc, log = start_run(tmp_path, flags)
    actor = int(wait_for(log, r"actor: 1 rank\(s\), pids \[(\d+)\]", proc).group(1))
    kill_after_rows(proc, log, tmp_path / "run" / "metrics.jsonl", 3, actor)  # step 2's checkpoint written
    wait_for(log, r"restarting the run's groups", proc)
    tree = descendants(proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    text = assert_stops_clean(proc, tree, t0, log)
    assert proc.returncode == 143, text[-2000:]
    last = text.strip().splitlines()[-1]
    where = re.match(STOP_LINE, last)
    assert where, text[-2000:]
    # (not "restart" in the line: the test's own folder is named so. A signal after the restart stops a step.)
    if where.group(1) == "the restart after a lost process":
        # "checkpoint ... kept" where the restarted controller had loaded step 2, "the newest checkpoint is ..." where
        # the lost attempt's controller (step 3) was the one in progress: both name the checkpoint and the command
        assert re.search(
            r"(checkpoint \S+step_00000[24] kept|the newest checkpoint is \S+step_00000[24]); run the same command "
            r"with --load_checkpoint to continue from it",
            last,
        ), last


def test_a_signal_saves_the_step_and_stops_cleanly(tmp_path):
    """A scheduler's SIGTERM (before: Ray's C++ stack dump, no checkpoint, no orlhf line), handled as Ctrl-C is
    (launch/stop_signals.py; tests/unit/test_stop_signals.py for SIGINT; tests/e2e/test_stop_sweep.py at each
    phase): the step in progress ends, is saved, and one line says what was kept and how to resume. An async run
    with a vLLM engine: the checkpoint also keeps the batch generated ahead (tests/e2e/test_resume.py resumes one),
    and the engine's process is gone when the driver exits (before, one was still alive seconds after)."""
    sig = signal.SIGTERM
    proc, log = start_run(tmp_path, ("--num_episodes", "50", "--async_train"))
    wait_for(log, r"vllm engines: 1, pids \[\d+\]", proc)
    first_step_logged(tmp_path, proc, log)
    tree = descendants(proc)
    t0 = time.monotonic()
    proc.send_signal(sig)
    text = assert_stops_clean(proc, tree, t0, log)
    assert proc.returncode == 128 + sig, text[-2000:]
    m = re.fullmatch(
        rf"\[orlhf\] stopped by {sig.name} during step (\d+): checkpoint (\S+) kept; run the same command with "
        r"--load_checkpoint to continue from it",
        text.strip().splitlines()[-1],
    )
    assert m, text[-2000:]
    assert Path(m.group(2)).name == f"step_{int(m.group(1)):06d}" and (Path(m.group(2)) / "meta.json").exists()
    (ahead,) = json.loads((Path(m.group(2)) / "controller.json").read_text())["pending"]
    assert ahead["rollouts"]["rows"]


@pytest.mark.parametrize(
    "lr, line, saved, flags",
    [
        # losses, KL and the engine gap went NaN from step 2, metrics.jsonl wrote null, and the run ended rc 0
        # exporting weights of ~5e29
        (
            "1e30",
            r"error: step 2: .*nan.* the updates diverged, so the run stops before these weights reach the engines, a "
            r"checkpoint or the export\. Train again with a lower --actor_learning_rate \(now 1e\+30\)\.",
            ["step_000001"],  # step 1's, whose numbers were finite; never step 2's
            [],
        ),
        # the policy saturated: its gradient exactly 0 from step 2 on; the run warned, trained on and exported, rc 0.
        # Seen under ZeRO-2 (the one-rank default then), which drops a non-finite step 2 and leaves the saturated
        # policy; without ZeRO the same learning rate's step 2 gradient is NaN, and the diverged line above stops it.
        (
            "1e3",
            r"error: step (\d+): the actor's gradient norm is exactly 0 while its loss is not \(.*\), as on the step "
            r"before: .* so the policy collapsed and learns nothing more; the run stops here, before these weights "
            r"reach the engines, a checkpoint or the export\. The updates were too large: train again with a lower "
            r"--actor_learning_rate \(now 1000\)\.",
            None,  # every step before the one that stopped it
            ["--zero_stage", "2"],
        ),
    ],
    ids=["diverged", "collapsed"],
)
def test_a_diverged_or_collapsed_run_stops_before_its_weights_go_anywhere(tmp_path, lr, line, saved, flags):
    """One `error:` line, exit 1, nothing exported; the checkpoints are those of the steps before the stop."""
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
            lr,
            "--save_steps",
            "1",
            "--vllm_num_engines",
            "0",  # the check is the driver's: the actor's ranks generate, no engine start-up to wait for
            "--save_path",
            str(save),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1, res.stderr[-3000:]
    m = re.fullmatch(line, last)
    assert m, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert not (save / "actor").exists()
    if saved is None:
        saved = [f"step_{s:06d}" for s in range(max(1, int(m.group(1)) - 3), int(m.group(1)))]  # the newest 3 kept
    assert sorted(p.name for p in (save / "checkpoints_ppo").glob("step_*")) == saved


# 6 steps of 32 prompts, a checkpoint every 2
RESTART_FLAGS = (
    "--max_samples",
    "192",
    "--rollout_batch_size",
    "32",
    "--train_batch_size",
    "32",
    "--num_episodes",
    "1",
    "--save_steps",
    "2",
)


def assert_restarted_from_the_newest_checkpoint(text: str, save: Path) -> int:
    """What the design promises for a lost actor rank under --max_restarts 1, whenever the loss is noticed (the step
    in progress, its checkpoint, the export): one restart, from the newest checkpoint complete when it was lost (the
    last "checkpoint <path> (...)" line before the loss), said in the log and restarts.jsonl, and every step logged
    once, those after the checkpoint by the restarted groups. Returns the checkpoint's step."""
    lost = re.search(
        r"actor rank 0 lost (during step (\d+)|during the checkpoint of step (\d+)|during the export) \(.*\); "
        r"restarting the run's groups \(restart 1 of --max_restarts 1\)",
        text,
    )
    assert lost, text[-3000:]
    saved = re.findall(r"\[orlhf\] checkpoint (\S+step_(\d{6})) \(", text[: lost.start()])
    assert saved, text[-3000:]
    newest, at = saved[-1][0], int(saved[-1][1])
    assert f"restart 1: resuming from {newest} (step {at})" in text, text[-3000:]
    (record,) = [json.loads(line) for line in (save / "restarts.jsonl").read_text().splitlines()]
    assert record["lost"][0] == "actor rank 0" and record["at"] == at and record["resumed_from"] == newest, record
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["run_restarts"] for r in rows] == [int(r["step"] > at) for r in rows]
    print(f"actor rank lost {lost.group(1)}; resumed from step {at}")
    return at


def kill_after_rows(proc, log: Path, metrics: Path, rows: int, pid: int, sig=signal.SIGKILL) -> float:
    """kill -9 `pid` (or send it `sig`) as soon as metrics.jsonl has `rows` rows (the next step just began); returns
    the time."""
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    os.kill(pid, sig)
    return time.monotonic()


def test_a_killed_or_hung_engine_is_replaced_and_a_killed_rank_restarts_the_run_as_if_nothing_happened(tmp_path):
    """One run, three faults. kill -9 the engine as step 3 starts (step 2's row just written): a new engine on its
    bundles, a fresh weight-sync group, the current weights loaded, step 3's prompts generated again with their seeds.
    SIGSTOP that new engine as step 4 starts: alive but silent, its health checks go unanswered for --hang_timeout_s
    (distributed/heartbeat.py; before, its generate waited the whole --ray_timeout_s), so it is killed and replaced
    the same way. Then kill -9 the actor's rank as step 6 starts (--max_restarts 1): every group and engine is started
    again from the newest checkpoint (step 4's, unless the loss is noticed only once step 6 is saved), the steps after
    it trained again. Before, each stopped the run naming what was
    lost. Now it ends normally, each step logged once, its numbers those of the same run undisturbed (sync mode: seeded
    throughout), the engine gap within the sync guard after the replacement; the log and restarts.jsonl say what was
    lost at which step and where the run resumed; the engine restart is kept in the checkpoint."""
    clean, clean_log = start_run(tmp_path, RESTART_FLAGS, "clean")
    assert clean.wait(timeout=600) == 0, clean_log.read_text()[-3000:]
    undisturbed = [json.loads(line) for line in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]

    proc, log = start_run(tmp_path, (*RESTART_FLAGS, "--max_restarts", "1", "--hang_timeout_s", "10"), "killed")
    engine = int(wait_for(log, r"vllm engines: 1, pids \[(\d+)\]", proc).group(1))
    actor = int(wait_for(log, r"actor: 1 rank\(s\), pids \[(\d+)\]", proc).group(1))
    save = tmp_path / "killed"
    t_kill = kill_after_rows(proc, log, save / "metrics.jsonl", 2, engine)
    while len((save / "metrics.jsonl").read_text().splitlines()) < 3 and proc.poll() is None:
        time.sleep(0.2)
    kill_to_step = time.monotonic() - t_kill
    second = int(wait_for(log, r"step 3: vllm engine 0 replaced in [\d.]+ s \(pid (\d+)\)", proc).group(1))
    t_stop = kill_after_rows(proc, log, save / "metrics.jsonl", 3, second, signal.SIGSTOP)
    while len((save / "metrics.jsonl").read_text().splitlines()) < 4 and proc.poll() is None:
        time.sleep(0.2)
    stop_to_step = time.monotonic() - t_stop
    t_actor = kill_after_rows(proc, log, save / "metrics.jsonl", 5, actor)
    while len((save / "metrics.jsonl").read_text().splitlines()) < 6 and proc.poll() is None:
        time.sleep(0.2)  # step 5's row is cut and written again, then step 6's
    actor_to_step = time.monotonic() - t_actor
    tree = descendants(proc)  # the restarted groups and engines, as the run ends
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert not [p for p in tree if running(p)]  # the driver waited for them (before, an engine outlived it)
    print(f"actor rank killed -> step 6's row: {actor_to_step:.1f} s")
    text = log.read_text()
    assert "(raylet)" not in text and "A worker died" not in text  # Ray's notices of the deaths: in driver.log
    assert "A worker died or was killed" in (save / "logs" / "driver.log").read_text()
    m = re.search(r"step 3: vllm engine 0 died during (generate|the weight sync); replacing it", text)
    assert m, text[-3000:]
    took = re.search(r"step 3: vllm engine 0 replaced in ([\d.]+) s \(pid (\d+)\)", text)
    assert took and int(took.group(2)) != engine, text[-3000:]
    print(f"engine lost during {m.group(1)}; replaced in {took.group(1)} s; kill to step 3's row: {kill_to_step:.1f} s")
    hung = re.search(
        r"step 4: vllm engine 0 stopped answering health checks \(--hang_timeout_s\) during (generate|the weight "
        r"sync); replacing it",
        text,
    )
    assert hung, text[-3000:]
    third = re.search(r"step 4: vllm engine 0 replaced in ([\d.]+) s \(pid (\d+)\)", text)
    assert third and int(third.group(2)) not in (engine, second), text[-3000:]
    print(f"engine hung during {hung.group(1)}; replaced in {third.group(1)} s; ", end="")
    print(f"SIGSTOP to step 4's row: {stop_to_step:.1f} s")
    assert_restarted_from_the_newest_checkpoint(text, save)
    pids = re.findall(r"actor: 1 rank\(s\), pids \[(\d+)\]", text)
    assert len(pids) == 2 and int(pids[1]) != actor, pids

    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in undisturbed]
    assert [r["engine_restarts"] for r in rows] == [0, 0, 1, 2, 2, 2]  # the resumed checkpoint kept the count
    assert all(r["engine_logprob_gap"] < 1e-3 for r in rows[2:]), [r["engine_logprob_gap"] for r in rows]
    for key in ("reward_mean", "kl", "policy_loss"):
        assert [r[key] for r in rows] == [r[key] for r in undisturbed], key
    assert (save / "actor" / "config.json").exists()
