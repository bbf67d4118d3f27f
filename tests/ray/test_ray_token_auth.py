"""`orlhf plan --address` against a running head with token authentication and 4 (logical) GPUs, started here with
`ray start --head` (own temp dir and ports) and a fake nvidia-smi on its PATH, which its workers inherit:
- without the cluster's token: one line that names the address and says what to set, at Ray's first refusal (not
  after its connect retries), and none of Ray's C++ lines on the terminal;
- with it: each GPU node's memory is what nvidia-smi reports there (81559 MiB -> 79.6 GiB); --gpu_memory_gb wins
  without asking nvidia-smi; a node without nvidia-smi stays unknown ("pass --gpu_memory_gb").
Each plan is a subprocess: Ray reads its authentication settings once per process.
"""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
TOKEN = secrets.token_hex(16)
FAKE_NVIDIA_SMI = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
echo 81559
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """(address, the fake nvidia-smi's folder) of a token-authenticated head on loopback."""
    tools = tmp_path_factory.mktemp("tools")
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    temp_dir = Path("/tmp") / f"orlhf-tok-{secrets.token_hex(3)}"  # Ray socket paths must stay short
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, "PATH": f"{tools}:{os.environ['PATH']}"}
    ports = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port)]
    command += ["--node-ip-address", "127.0.0.1", "--temp-dir", str(temp_dir), "--num-cpus", "4", "--num-gpus", "4"]
    command += ["--include-dashboard", "false", "--include-log-monitor", "false", "--disable-usage-stats"]
    command += [arg for flag in ports for arg in (flag, str(free_port()))]
    log = tools / "head.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", tools
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the head's processes are all in its session (a graceful stop is slow)
        proc.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def plan(address: str, *flags: str, **env: str) -> tuple[int, str, str, float]:
    """`orlhf plan --address` in a new process, without Ray's authentication settings unless `env` gives them."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    argv = [sys.executable, "-m", "orlhf.cli", "plan", "--address", address, "--device", "cuda", *flags]
    start = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**base, "HOME": "/nonexistent", **env})
    return res.returncode, res.stdout, res.stderr, time.monotonic() - start


def test_without_the_token_one_line_says_what_to_set(head):
    address, _ = head
    code, out, err, seconds = plan(address)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"error: the Ray cluster at {address} uses token authentication and RAY_AUTH_MODE is not 'token' here: set "
        "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token, or RAY_AUTH_TOKEN_PATH to a file holding it "
        "(`ray get-auth-token` on its head node prints the token)"
    ]
    assert seconds < 18  # the first refusal ends the connect (Ray alone retries 20 times, a second apart)
    code, _, err, _ = plan(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32)
    assert code == 2 and err.count("\n") == 1 and "refused the token from RAY_AUTH_TOKEN" in err


def gpu_column(out: str) -> set[str]:
    """The 'GiB per GPU' cells of plan's per-GPU table."""
    rows = out[out.index("per GPU (") :].split("\n\n")[0].splitlines()[2:]  # title, header, rows
    return {row.split()[2] for row in rows}


def test_gpu_memory_is_read_on_the_node_unless_given(head):
    address, tools = head
    calls = tools / "calls"
    with_token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    code, out, err, _ = plan(address, **with_token)
    assert code in (0, 1), err
    assert gpu_column(out) == {"79.6"} and "GPU memory unknown" not in out
    assert calls.read_text().split("\n")[0] == "--query-gpu=memory.total --format=csv,noheader,nounits"
    asked = calls.read_text()
    code, out, err, _ = plan(address, "--gpu_memory_gb", "40", **with_token)
    assert gpu_column(out) == {"40"} and calls.read_text() == asked  # given: nvidia-smi not asked
    (tools / "nvidia-smi").unlink()  # a node without nvidia-smi (or without NVIDIA GPUs): unknown, as before
    code, out, err, _ = plan(address, **with_token)
    assert gpu_column(out) == {"?"} and "(GPU memory unknown: pass --gpu_memory_gb)" in out
