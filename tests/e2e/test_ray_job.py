"""`ray job submit`-style run: a local head on loopback (own temp dir, token auth), the demo through the Jobs API."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_through_ray_jobs_api(tmp_path):
    ray_bin = Path(sys.executable).parent / "ray"
    temp_dir = Path("/tmp") / f"orlhf-rj-{secrets.token_hex(3)}"  # Ray socket paths must stay short
    gcs_port, dash_port, agent_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "PATH": f"{ray_bin.parent}:{os.environ['PATH']}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    head = subprocess.Popen(
        [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            "--port",
            str(gcs_port),
            "--node-ip-address",
            "127.0.0.1",
            "--temp-dir",
            str(temp_dir),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dash_port),
            "--num-cpus",
            "8",
            "--include-dashboard",
            "true",
            "--disable-usage-stats",
            # the agent's default port (52365) is the test session's own cluster's when it runs: the Jobs API
            # would then wait forever for an agent ("No available agent to submit job")
            "--dashboard-agent-listen-port",
            str(agent_port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while (
            subprocess.run(
                [str(ray_bin), "job", "list", "--address", f"http://127.0.0.1:{dash_port}"],
                env=env,
                capture_output=True,
            ).returncode
            != 0
        ):
            assert time.monotonic() < deadline and head.poll() is None, "the Ray head did not come up"
            time.sleep(2)
        save = tmp_path / "job"
        runtime_env = json.dumps(
            {"env_vars": {"HF_HUB_OFFLINE": "1", "ORLHF_CACHE": os.environ.get("ORLHF_CACHE", "")}}
        )
        # The same command scripts/train_ppo_ray.sh runs; it waits for the job and exits non-zero if it fails.
        submit = [
            str(ray_bin),
            "job",
            "submit",
            "--address",
            f"http://127.0.0.1:{dash_port}",
            "--runtime-env-json",
            runtime_env,
            "--",
            "orlhf",
            "train-ppo",
            "--num_episodes",
            "1",
            "--max_samples",
            "128",
            "--device",
            "cpu",
            "--save_path",
            str(save),
        ]
        deadline = time.monotonic() + 180
        while True:  # the dashboard answers before its job agent is up: Ray says "try again later"
            job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400)
            if "No available agent to submit job" not in job.stdout + job.stderr:
                break
            assert time.monotonic() < deadline, "the head's job agent never came up: " + job.stderr[-1000:]
            time.sleep(2)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-2000:]
        assert "succeeded" in job.stdout and "done: 2 steps" in job.stdout
        assert len((save / "metrics.jsonl").read_text().splitlines()) == 2
    finally:
        # `ray start` alone, as `ray stop` does it: it drains its node through the GCS, then stops its processes. A
        # SIGTERM to its whole group would end the GCS first, and the drain would wait out its 30 s for it.
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)
        time.sleep(2)
        left = subprocess.run(["pgrep", "-f", str(temp_dir)], capture_output=True, text=True).stdout.split()
        for pid in left:  # a straggler after the graceful stop: do not leak it into later tests
            os.kill(int(pid), signal.SIGKILL)
        assert not left, f"Ray processes of the test head outlived it: {left}"
