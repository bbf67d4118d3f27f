"""`orlhf train-ppo --address` on a Ray cluster of three hosts (tests/multihost/hosts.py): the head and the driver on
hosts[0] (no CPUs for work), one CPU on each of hosts[1] and hosts[2], so the actor's rank (its reference and critic
hosted in its process) and the vLLM engine land on different hosts, as a user's flags place them.

Both worker hosts also have a second interface that reaches nothing, holding their default route and what the
machine's hostname resolves to (a docker bridge, a management network): gloo's own choice would be that address,
or 127.0.0.1, and its peers would wait on it. The weight sync and DeepSpeed must take the route to the head; a run
told to use the dead interface (--socket_ifname) stops before its first step with one line naming the address and the
flag. The run learns, the engine equals the trainer after every sync, and each step's sync crosses both links.
"""

import json
import re
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multihost, pytest.mark.ray, pytest.mark.vllm, pytest.mark.e2e]
ORLHF = str(Path(sys.executable).parent / "orlhf")
# The demo's preset (8 steps of 64 prompts an episode) and its 5-episode schedule, stopped after 32 steps: the demo is
# seeded, so these are the rewards of any 5-episode demo run's first 32 steps (last 8 ~1.5x the first 8).
STEPS, N = ("--num_episodes", "5", "--stop_after_steps", "32"), 32


def start_run(hosts, save: Path, *flags: str):
    """The driver on the head's host, joining the cluster at the head's address, as a user there would."""
    import subprocess

    log = save.with_suffix(".log")
    argv = hosts.head.argv(ORLHF, "train-ppo", "--address", hosts.address, "--device", "cpu", "--save_path", str(save))
    out = open(log, "w")
    proc = subprocess.Popen(
        [*argv, *flags], stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=hosts.env
    )
    return proc, log


def wait_for(log: Path, pattern: str, proc, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in the log within {timeout} s:\n{log.read_text()[-3000:]}")


def host_of(hosts, pid: int):
    (found,) = [h for h in hosts.hosts if pid in h.pids()]
    return found


def rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_actor_and_engine_on_two_hosts_sync_over_the_link(hosts, tmp_path):
    h0, h1, h2 = hosts.hosts
    dead = [hosts.add_dead_interface(h) for h in (h1, h2)]
    hosts.start_ray(h0, num_cpus=0)
    hosts.start_ray(h1, num_cpus=1)
    hosts.start_ray(h2, num_cpus=1)
    t0 = time.monotonic()
    # An interface the hosts do not share: the run stops before its first step, naming the address and the flag.
    proc, log = start_run(hosts, tmp_path / "unreachable", *STEPS, "--socket_ifname", hosts.tag + "d")
    assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    print(f"unreachable run: {time.monotonic() - t0:.0f} s")
    (line,) = [x for x in log.read_text().splitlines() if x.startswith("error:")]
    assert re.fullmatch(
        r"error: the weight-sync group's store on actor rank 0 at 172\.31\.\d+\.2:\d+ cannot be reached from "
        r"172\.31\.\d+\.2 \(.+\): set --socket_ifname to an interface the hosts reach each other on",
        line,
    ), line
    assert not rows(tmp_path / "unreachable" / "metrics.jsonl")
    save = tmp_path / "run"
    proc, log = start_run(hosts, save, *STEPS)
    try:
        engine = host_of(hosts, int(wait_for(log, r"vllm engines: 1, pids \[(\d+)\]", proc).group(1)))
        actor = host_of(hosts, int(wait_for(log, r"actor: 1 rank\(s\), pids \[(\d+)\]", proc).group(1)))
        assert {engine, actor} == {h1, h2}
        metrics, counted = save / "metrics.jsonl", []  # (rows, engine link bytes, actor link bytes) at each new row
        while proc.poll() is None:
            n = len(rows(metrics))
            if not counted or n > counted[-1][0]:
                counted.append((n, hosts.link_bytes(engine), hosts.link_bytes(actor)))
            time.sleep(0.05)
        assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    sync = re.search(r"weight sync: gloo group of 2 .* at ([\d.]+):\d+, \d+ tensors \((\d+) bytes\)", text)
    assert sync and sync.group(1) == actor.ip, text[-3000:]  # not 127.0.0.1, not the dead interface
    assert not any(d in text for d in dead)
    synced = int(sync.group(2))
    out = rows(save / "metrics.jsonl")
    assert [r["step"] for r in out] == list(range(1, N + 1))
    first, last = (sum(r["reward_mean"] for r in part) / 8 for part in (out[:8], out[-8:]))
    print(f"reward: first 8 steps {first:.3f}, last 8 {last:.3f} (x{last / first:.2f})")
    assert last >= 1.3 * first, [round(r["reward_mean"], 3) for r in out]  # the run learns
    assert all(r["engine_logprob_gap"] < 1e-3 for r in out), [r["engine_logprob_gap"] for r in out]
    # Between two rows: one sync (actor -> engine over both links) plus that step's prompts and rollouts.
    steps = [(b[1] - a[1], b[2] - a[2]) for a, b in zip(counted, counted[1:]) if b[0] == a[0] + 1 and a[0] >= 1]
    assert len(steps) >= 2, counted
    span = [f"{min(x) / synced:.2f}-{max(x) / synced:.2f}" for x in zip(*steps)]
    print(f"synced {synced} bytes a step; link bytes a step / synced: engine host {span[0]}x, actor host {span[1]}x")
    for through_engine, through_actor in steps:
        assert synced <= through_engine < 1.5 * synced, (synced, steps)
        assert synced <= through_actor < 1.5 * synced, (synced, steps)
