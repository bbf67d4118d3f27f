"""`orlhf serve-rm`: loopback by default, bearer token, OpenRLHF's JSON format, and HttpReward against it."""

import threading

import pytest
import requests

from orlhf.demo import ensure_demo
from orlhf.rewards import HttpReward, RewardError
from orlhf.serve_rm import make_server


@pytest.fixture
def server():
    srv = make_server(str(ensure_demo().reward_fn), port=0, token="s3cret")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_binds_loopback_by_default(server):
    assert server.server_address[0] == "127.0.0.1"


def test_token_required_and_rewards_served(server):
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    body = {"query": ["say colors: red blue", "say colors: cat"], "prompts": ["say colors:"] * 2,
            "labels": ["colors", "colors"]}
    assert requests.post(url, json=body, timeout=10).status_code == 401
    assert requests.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    ok = requests.post(url, json=body, headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["rewards"] == [1.0, 0.0]  # "red blue": 2/2 colors; "cat": 0
    bad = requests.post(url, data=b"{not json", headers={"Authorization": "Bearer s3cret"}, timeout=10)
    assert bad.status_code == 400

    rewards = HttpReward(url, token="s3cret").score(body["query"], body["prompts"], body["labels"])
    assert rewards.tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match="401|token"):
        HttpReward(url, token="wrong", retries=0).score(body["query"], body["prompts"], body["labels"])


# ---- a real `orlhf serve-rm` process, spoken to with raw sockets on 127.0.0.1 ----

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _serve(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ORLHF_RM_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "orlhf.cli", "serve-rm", str(ensure_demo().reward_fn), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def rm_process():
    proc = _serve("--port", "0", "--timeout_s", "1", "--workers", "4")
    try:
        line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT/get_reward"
        port = int(re.search(r"127\.0\.0\.1:(\d+)/", line).group(1))
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _raw(port, data: bytes, timeout=10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _post(body: bytes, length=None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
            ).encode() + body


def _status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body).get("error", "")


GOOD = {"query": ["say colors: red blue"], "prompts": ["say colors:"], "labels": ["colors"]}


@pytest.mark.parametrize("request_bytes, reason", [
    (_post(b"{}", length="abc"), "Content-Length must be a number of bytes (got 'abc')"),
    (_post(b"{not json"), "body is not JSON"),
    (_post(json.dumps({"prompts": []}).encode()), 'expected a JSON object {"query"'),
    (_post(json.dumps({**GOOD, "query": "red"}).encode()), '"query" must be a list of strings (got str)'),
    (_post(json.dumps({**GOOD, "prompts": [1]}).encode()), '"prompts" must be a list of strings'),
    (_post(json.dumps({**GOOD, "labels": "x"}).encode()), '"labels" must be a list (got str)'),
    (_post(json.dumps({**GOOD, "prompts": ["a", "b"]}).encode()), "must have the same length (got 1, 2, 1)"),
    (_post(json.dumps({"query": []}).encode()), '"query" is empty'),
    (_post(b"{}", length=0), "body must be 1.."),
])
def test_each_malformed_request_gets_400_with_a_one_line_reason(rm_process, request_bytes, reason):
    _, port = rm_process
    code, error = _status_and_error(_raw(port, request_bytes))
    assert code == 400 and reason in error and "\n" not in error, error


def test_a_content_length_larger_than_the_body_is_answered_at_the_timeout(rm_process):
    _, port = rm_process
    t0 = time.monotonic()
    code, error = _status_and_error(_raw(port, _post(b'{"query": ["a"]}', length=500)))
    assert code == 408 and "Content-Length" in error and time.monotonic() - t0 < 5


def test_idle_connections_neither_pin_threads_nor_block_answers(rm_process):
    proc, port = rm_process
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(50)]
    try:
        time.sleep(0.5)
        assert psutil.Process(proc.pid).num_threads() <= 4 + 3  # the pool, the main thread, a little slack
        t0 = time.monotonic()
        code, _ = _status_and_error(_raw(port, _post(json.dumps(GOOD).encode()), timeout=30))
        assert code == 200 and time.monotonic() - t0 < 20  # 50 idle / 4 workers x 1 s timeout, plus slack
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()


def test_a_public_host_without_a_token_is_refused():
    proc = _serve("--host", "0.0.0.0", "--port", "0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--host 0.0.0.0" in err and "token" in err and "serving" not in out
