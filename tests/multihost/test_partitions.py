"""Partitions and lost hosts in a run across hosts (tests/multihost/hosts.py): 8 steps, a checkpoint every 2.

    step 4 starts   the actor's host is cut off (its link down: its processes live on, unreachable) for longer than
                    --hang_timeout_s: the run tears its groups down and waits for room; when the link is back the
                    cut host's raylet learns it was declared dead and ends, every process there with it; Ray starts
                    there again and the run's restart resumes step 2's checkpoint
    step 6 starts   every process of the actor's host is killed at once (a crashed machine): the same, from step 4's
    step 7 starts   the engine's host is cut off for longer than --hang_timeout_s; a second Ray node starts on the
                    head's host, which still reaches the head: the engine is replaced there and the step goes on
The run ends normally with each step logged once, and nothing of it is left running on any host.
"""

import json
import re
import time

import pytest

from tests.multihost.test_across_hosts import host_of, rows, start_run, wait_for

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.vllm, pytest.mark.e2e]
HANG_S = 10
FLAGS = (
    *("--max_samples", "256", "--rollout_batch_size", "32", "--train_batch_size", "32", "--num_episodes", "1"),
    *("--save_steps", "2", "--max_restarts", "2", "--hang_timeout_s", str(HANG_S), "--ray_timeout_s", "120"),
)


def until(condition, what: str, proc, log, timeout: float = 120) -> None:
    """Wait for `condition` while the run (`proc`; None: ended) lives, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc is None or proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what} not within {timeout} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def said(t0: float, what: str) -> None:
    """The test's timeline, in seconds since the run started (shown with -s)."""
    print(f"partitions: {time.monotonic() - t0:5.0f} s  {what}", flush=True)


def placed(hosts, log, after: int = 0):
    """(engine's host, actor's host) as the log's newest start-up (from offset `after`) names their processes."""
    text = log.read_text()[after:]
    engine = int(re.findall(r"vllm engines: 1, pids \[(\d+)\]", text)[-1])
    actor = int(re.findall(r"actor: 1 rank\(s\), pids \[(\d+)\]", text)[-1])
    return host_of(hosts, engine), host_of(hosts, actor)


def test_partitioned_and_crashed_hosts(hosts, tmp_path):
    h0, h1, h2 = hosts.hosts
    hosts.start_ray(h0, num_cpus=0)
    hosts.start_ray(h1, num_cpus=1)
    hosts.start_ray(h2, num_cpus=1)
    save = tmp_path / "run"
    metrics = save / "metrics.jsonl"
    proc, log = start_run(hosts, save, *FLAGS)
    t0 = time.monotonic()
    try:
        wait_for(log, r"weight sync: ", proc)
        engine, actor = placed(hosts, log)

        until(lambda: len(rows(metrics)) >= 3, "step 3", proc, log)  # step 2's checkpoint complete
        said(t0, "the actor's host cut off")
        hosts.cut(actor)
        cut_at = time.monotonic()
        wait_for(log, r"waiting up to \d+ s for a node to join", proc)
        until(lambda: time.monotonic() - cut_at > HANG_S, "the cut outlasting --hang_timeout_s", proc, log)
        said(t0, "the run waits for a node; the actor's host's link back")
        hosts.mend(actor)
        mark = len(log.read_text())
        hosts.start_ray(actor, num_cpus=1)  # the host is back
        until(lambda: "weight sync: " in log.read_text()[mark:], "the restart's start-up", proc, log)
        engine, actor = placed(hosts, log, mark)

        until(lambda: len(rows(metrics)) >= 5, "step 5", proc, log)
        said(t0, "every process of the actor's host killed")
        hosts.kill(actor)
        mark = len(log.read_text())
        wait_for(log, r"restart 2: resuming", proc)
        hosts.start_ray(actor, num_cpus=1)  # the machine is back
        until(lambda: "weight sync: " in log.read_text()[mark:], "the restart's start-up", proc, log)
        engine, actor = placed(hosts, log, mark)

        until(lambda: len(rows(metrics)) >= 6, "step 6", proc, log)
        said(t0, "the engine's host cut off; a second Ray node on the head's host")
        hosts.cut(engine)
        cut_at = time.monotonic()
        hosts.start_ray(h0, num_cpus=1)  # room on a host that still reaches the head
        wait_for(log, r"step 7: vllm engine 0 replaced in [\d.]+ s", proc)
        until(lambda: time.monotonic() - cut_at > HANG_S, "the cut outlasting --hang_timeout_s", proc, log)
        said(t0, "the engine replaced; the engine's host's link back")
        hosts.mend(engine)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        said(t0, "the run ended")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_recovered(log.read_text(), save)
    # Nothing of the run is left on any host once Ray has ended the finished job's workers: its own processes only.
    until(lambda: not run_processes(hosts), f"the run's processes ending {run_processes(hosts)}", None, log, timeout=60)
    said(t0, "none of the run's processes left on any host")


def assert_recovered(text: str, save) -> None:
    """What the run's log, metrics.jsonl and restarts.jsonl say about the three losses."""
    assert re.search(r"actor rank 0 lost (at|during) step 4 \(.*\); restarting the run's groups", text), text[-3000:]
    assert re.search(r"restart 1: resuming from \S+step_000002 \(step 2\)", text), text[-3000:]
    assert re.search(r"actor rank 0 lost (at|during) step 6 \(.*\); restarting the run's groups", text), text[-3000:]
    assert re.search(r"restart 2: resuming from \S+step_000004 \(step 4\)", text), text[-3000:]
    assert re.search(r"step 7: vllm engine 0 (died|stopped answering).*; replacing it", text), text[-3000:]
    # A first start sent to the lost node's bundle (before Ray declared the node dead) dies; the line says why.
    starts = [x for x in text.splitlines() if "died while starting" in x]
    assert all("its node has died" in x for x in starts), starts
    out = rows(save / "metrics.jsonl")
    assert [r["step"] for r in out] == list(range(1, 9))
    assert [r["run_restarts"] for r in out] == [0, 0, 1, 1, 2, 2, 2, 2]  # a row written again on a restart: its count
    assert [r["engine_restarts"] for r in out] == [0, 0, 0, 0, 0, 0, 1, 1]
    assert all(r["engine_logprob_gap"] < 1e-3 for r in out), [r["engine_logprob_gap"] for r in out]
    restarts = [json.loads(line) for line in (save / "restarts.jsonl").read_text().splitlines()]
    assert [(r["lost"][0], r["step"], r["at"]) for r in restarts] == [("actor rank 0", 4, 2), ("actor rank 0", 6, 4)]


def run_processes(hosts) -> list[str]:
    """Command lines of the run's processes (driver, rank and engine actors) still alive on any host."""
    found = []
    for pid in [p for h in hosts.hosts for p in h.pids()]:
        try:
            line = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:  # ended meanwhile
            continue
        if "/bin/orlhf " in line or "RankActor" in line or "EngineActor" in line:
            found.append(line)
    return found
