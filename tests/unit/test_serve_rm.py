"""`orlhf serve-rm`: loopback by default, bearer token, OpenRLHF's JSON format, and HttpReward against it."""

import threading

import pytest
import requests

from orlhf.demo.builder import ensure_demo
from orlhf.inputs.http_reward import HttpReward
from orlhf.inputs.reward_server import make_server
from orlhf.inputs.rewards import RewardError


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
    body = {
        "query": ["say colors: red blue", "say colors: cat"],
        "prompts": ["say colors:"] * 2,
        "labels": ["colors", "colors"],
    }
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


def _serve(*args, reward_fn=None):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ORLHF_RM_TOKEN", None)
    reward_fn = reward_fn or ensure_demo().reward_fn
    return subprocess.Popen(
        [sys.executable, "-m", "orlhf.cli", "serve-rm", str(reward_fn), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _port(proc) -> int:
    line = proc.stdout.readline()  # "serving ... on http://127.0.0.1:PORT/get_reward"
    return int(re.search(r"127\.0\.0\.1:(\d+)/", line).group(1))


@pytest.fixture(scope="module")
def rm_process():
    proc = _serve("--port", "0", "--timeout_s", "1", "--workers", "4")
    try:
        yield proc, _port(proc)
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
    return (
        f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    ).encode() + body


def _status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body).get("error", "")


GOOD = {"query": ["say colors: red blue"], "prompts": ["say colors:"], "labels": ["colors"]}


@pytest.mark.parametrize(
    "request_bytes, reason",
    [
        (_post(b"{}", length="abc"), "Content-Length must be a number of bytes (got 'abc')"),
        (_post(b"{not json"), "body is not JSON"),
        (_post(json.dumps({"prompts": []}).encode()), 'expected a JSON object {"query"'),
        (_post(json.dumps({**GOOD, "query": "red"}).encode()), '"query" must be a list of strings (got str)'),
        (_post(json.dumps({**GOOD, "prompts": [1]}).encode()), '"prompts" must be a list of strings'),
        (_post(json.dumps({**GOOD, "labels": "x"}).encode()), '"labels" must be a list (got str)'),
        (_post(json.dumps({**GOOD, "prompts": ["a", "b"]}).encode()), "must have the same length (got 1, 2, 1)"),
        (_post(json.dumps({"query": []}).encode()), '"query" is empty'),
        (_post(b"{}", length=0), "body must be 1.."),
    ],
)
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


def _drip(port, at_once: bytes, dripped: bytes, every_s=0.2) -> tuple[bytes, float]:
    """Send `at_once`, then `dripped` one byte every `every_s` until the server answers or hangs up; returns the
    answer and the seconds from the first byte to it."""
    import select

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        t0 = time.monotonic()
        try:
            s.sendall(at_once)
            for i in range(len(dripped)):
                if select.select([s], [], [], every_s)[0]:  # an answer (or the close) is there: stop sending
                    break
                s.sendall(dripped[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks), time.monotonic() - t0


@pytest.mark.parametrize("split", ["request line", "body"])
def test_a_client_sending_a_byte_at_a_time_gets_408_at_the_deadline(rm_process, split):
    """--timeout_s 1 bounds the whole request read: a byte every 0.2 s never trips a per-read timeout (which
    would hold a worker for the whole drip and then answer 200)."""
    _, port = rm_process
    request = _post(json.dumps(GOOD).encode())
    cut = 0 if split == "request line" else request.index(b"\r\n\r\n") + 4
    answer, seconds = _drip(port, request[:cut], request[cut:])
    code, error = _status_and_error(answer)
    assert code == 408 and "within 1 s" in error, error
    assert seconds < 2.5  # 1 s deadline, a drip interval, slack for a loaded machine


SLOW_REWARD = """
import time

def reward_func(queries, prompts, labels):
    if queries[0] == "slow":
        time.sleep(4)
    return [1.0] * len(queries)
"""


def test_no_second_reward_func_call_while_a_timed_out_one_still_runs(tmp_path):
    """reward_func need not be thread-safe: after a call passes --reward_timeout_s (500, the call abandoned but
    still running) the next request gets 503 until that call returns, then 200 again."""
    path = tmp_path / "slow_reward.py"
    path.write_text(SLOW_REWARD)
    proc = _serve("--port", "0", "--reward_timeout_s", "0.5", "--timeout_s", "5", reward_fn=path)
    try:
        port = _port(proc)
        fast = _post(json.dumps({"query": ["fast"]}).encode())
        t0 = time.monotonic()
        code, error = _status_and_error(_raw(port, _post(json.dumps({"query": ["slow"]}).encode())))
        assert code == 500 and "did not return within 0.5 s" in error, error
        code, error = _status_and_error(_raw(port, fast))
        assert code == 503 and error.startswith("busy: the previous reward_func call has not returned"), error
        time.sleep(max(0.0, t0 + 4.5 - time.monotonic()))  # the slow call has returned by now
        code, _ = _status_and_error(_raw(port, fast))
        assert code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
