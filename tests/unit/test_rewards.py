"""Reward sources: a python reward file and an HTTP reward server, and the errors that name what went wrong."""

import json
import pickle
import socket
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from orlhf.demo.builder import ensure_demo
from orlhf.inputs.rewards import (
    FunctionReward,
    HttpReward,
    RewardBusy,
    RewardError,
    RewardSource,
    make_reward_source,
    to_rewards,
)

QUERIES = ["say colors: red blue", "say colors: cat dog"]
PROMPTS = ["say colors:", "say colors:"]
LABELS = ["colors", None]


def reward_file(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# ---- FunctionReward ----


def test_demo_reward_file_scores_through_function_reward():
    source = make_reward_source(str(ensure_demo().reward_fn))
    assert isinstance(source, FunctionReward) and isinstance(source, RewardSource)
    rewards = source.score(QUERIES, PROMPTS, LABELS)  # " red blue": all colors; " cat dog": none
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0]
    assert pickle.loads(pickle.dumps(source)).score(QUERIES, PROMPTS, LABELS).tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "answer",
    ["[0.5, 1]", "np.array([0.5, 1.0])", "torch.tensor([[0.5], [1.0]])", "{'rewards': [0.5, 1], 'scores': [0, 0]}"],
)
def test_function_reward_accepts_lists_arrays_tensors_and_dicts(tmp_path, answer):
    path = reward_file(
        tmp_path,
        f"""
        import numpy as np, torch
        def reward_func(queries, prompts, labels):
            assert labels == ["colors", ""]  # None labels arrive as "", as in OpenRLHF
            return {answer}
    """,
    )
    assert FunctionReward(path).score(QUERIES, PROMPTS, LABELS).tolist() == [0.5, 1.0]


def test_file_that_fails_to_import_names_file_line_and_error(tmp_path):
    path = reward_file(
        tmp_path,
        """
        import torch
        THRESHOLD = 1 / 0
        def reward_func(queries, prompts, labels):
            return torch.zeros(len(queries))
    """,
    )
    with pytest.raises(RewardError) as e:
        FunctionReward(path)
    msg = str(e.value)
    assert "my_reward.py failed to import: ZeroDivisionError: division by zero" in msg
    assert "my_reward.py, line 3" in msg and "THRESHOLD = 1 / 0" in msg


def test_syntax_error_is_a_reward_error(tmp_path):
    with pytest.raises(RewardError, match=r"my_reward\.py failed to import: SyntaxError"):
        FunctionReward(reward_file(tmp_path, "def reward_func(:\n"))


def test_file_without_reward_func_says_what_to_define(tmp_path):
    with pytest.raises(RewardError, match=r"my_reward\.py defines no reward_func; define `def reward_func\(queries"):
        FunctionReward(reward_file(tmp_path, "def reward(queries):\n    return []\n"))
    with pytest.raises(RewardError, match="reward_func is a int, not a function"):
        FunctionReward(reward_file(tmp_path, "reward_func = 3\n"))
    with pytest.raises(RewardError, match="missing.py: no such file"):
        make_reward_source(str(tmp_path / "missing.py"))


def test_reward_func_that_raises_is_wrapped_with_file_and_exception(tmp_path):
    path = reward_file(
        tmp_path,
        """
        def reward_func(queries, prompts, labels):
            return [len(q) / labels.index("nope") for q in queries]
    """,
    )
    with pytest.raises(RewardError) as e:
        FunctionReward(path).score(QUERIES, PROMPTS, LABELS)
    msg = str(e.value)
    assert "my_reward.py: reward_func raised ValueError" in msg and "my_reward.py, line 3" in msg
    assert isinstance(e.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "answer, problem",
    [
        ("[1.0]", r"returned shape \(1,\) for 2 queries; return one reward per query, shape \(2,\)"),
        ("[[1.0, 2.0], [3.0, 4.0]]", r"returned shape \(2, 2\) for 2 queries"),
        ("[0.0, float('nan')]", r"returned 1 non-finite rewards \(NaN/inf\) at indices \[1\] \(1: nan\)"),
        ("[float('inf'), 0.0]", r"returned 1 non-finite rewards \(NaN/inf\) at indices \[0\]"),
        ("['good', 'bad']", r"returned non-numeric rewards \(list: \['good', 'bad'\]\)"),
        ("{'score': [1, 2]}", r"returned a dict without 'rewards' \(keys: \['score'\]\)"),
    ],
)
def test_bad_answers_name_the_file_and_problem(tmp_path, answer, problem):
    path = reward_file(tmp_path, f"def reward_func(queries, prompts, labels):\n    return {answer}\n")
    with pytest.raises(RewardError, match=r"my_reward\.py: reward_func " + problem):
        FunctionReward(path).score(QUERIES, PROMPTS, LABELS)


def test_openrlhf_dict_keeps_scores_for_filtering_and_extra_logs(tmp_path):
    path = reward_file(
        tmp_path,
        """
        import torch
        def reward_func(queries, prompts, labels):
            return {"rewards": torch.tensor([0.5, 1.0]), "scores": torch.tensor([1.0, 0.0]),
                    "extra_logs": {"format_ok": torch.tensor([1.0, 0.0]), "batch_len": 7}}
    """,
    )
    result = FunctionReward(path).evaluate(QUERIES, PROMPTS, LABELS)
    assert result.rewards.tolist() == [0.5, 1.0] and result.scores.tolist() == [1.0, 0.0]
    assert {k: v.tolist() for k, v in result.extra_logs.items()} == {"format_ok": [1.0, 0.0], "batch_len": [7.0, 7.0]}
    assert result.log_row() == {"reward/format_ok": 0.5, "reward/batch_len": 7.0}
    plain = FunctionReward(reward_file(tmp_path, "def reward_func(q, p, l):\n    return [0.0, 2.0]\n", "b.py"))
    result = plain.evaluate(QUERIES, PROMPTS, LABELS)
    assert result.scores.tolist() == [0.0, 2.0] and result.extra_logs == {}  # scores default to rewards


@pytest.mark.parametrize(
    "answer, problem",
    [
        ("{'rewards': [1, 2], 'scores': [1]}", r"\['scores'\] returned shape \(1,\) for 2 queries"),
        ("{'rewards': [1, 2], 'extra_logs': [1, 2]}", r"returned 'extra_logs' as a list"),
        ("{'rewards': [1, 2], 'extra_logs': {'acc': ['a', 'b']}}", r"\['extra_logs'\]\['acc'\] returned non-numeric"),
    ],
)
def test_bad_dict_parts_name_the_part(tmp_path, answer, problem):
    path = reward_file(tmp_path, f"def reward_func(queries, prompts, labels):\n    return {answer}\n")
    with pytest.raises(RewardError, match=problem):
        FunctionReward(path).evaluate(QUERIES, PROMPTS, LABELS)


def test_a_stuck_reward_func_fails_at_its_deadline_naming_the_file(tmp_path):
    path = reward_file(
        tmp_path,
        """
        import threading
        def reward_func(queries, prompts, labels):
            threading.Event().wait()  # never returns
    """,
    )
    t0 = time.monotonic()
    with pytest.raises(
        RewardError,
        match=r"my_reward\.py: reward_func did not return within 0\.5 s "
        r"\(--reward_timeout_s\)",
    ):
        FunctionReward(path, timeout_s=0.5).score(QUERIES, PROMPTS, LABELS)
    assert time.monotonic() - t0 < 5
    source = make_reward_source(path, timeout_s=0.3)
    assert pickle.loads(pickle.dumps(source)).timeout_s == 0.3


def test_no_call_starts_while_a_timed_out_call_still_runs(tmp_path):
    """reward_func need not be thread-safe: the abandoned call must return before another one starts."""
    path = reward_file(
        tmp_path,
        """
        import threading
        release = threading.Event()
        def reward_func(queries, prompts, labels):
            if queries[0] == "stuck":
                release.wait()
            return [1.0] * len(queries)
    """,
    )
    source = FunctionReward(path, timeout_s=0.3)
    with pytest.raises(RewardError, match="did not return within 0.3 s"):
        source.score(["stuck"], [""], [""])
    with pytest.raises(RewardBusy, match="has not returned yet; no other call starts beside it"):
        source.score(QUERIES, PROMPTS, LABELS)
    source._func.__globals__["release"].set()  # the stuck call returns
    source._abandoned.join(5)
    assert source.score(QUERIES, PROMPTS, LABELS).tolist() == [1.0, 1.0]


def test_to_rewards_lists_at_most_ten_bad_indices():
    with pytest.raises(RewardError, match=r"12 non-finite .* indices \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\] \.\.\."):
        to_rewards(torch.full((12,), float("nan")), 12, "src")


def test_make_reward_source_rejects_other_values():
    with pytest.raises(RewardError, match=r"--remote_rm_url ftp://x: expected an http\(s\)://"):
        make_reward_source("ftp://x")
    assert isinstance(make_reward_source("http://127.0.0.1:1/score"), HttpReward)


# ---- HttpReward against a local server ----


class RewardServer:
    """A tiny HTTP reward server on 127.0.0.1 (random port). `behave(n, body)` -> (status, answer) per request n."""

    def __init__(self, behave):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((body, self.headers.get("Authorization")))
                status, answer = behave(len(server.requests), body)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def log_message(self, *args):
                pass

        self.requests = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        # A short poll interval: shutdown() waits up to one interval, and each test closes its server.
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(behave):
        servers.append(RewardServer(behave))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def length_rewards(n, body):
    return 200, {"rewards": [float(len(q)) for q in body["query"]], "scores": [0.0] * len(body["query"])}


def test_http_reward_posts_openrlhf_format_with_bearer_token(serve, monkeypatch):
    server = serve(length_rewards)
    monkeypatch.setenv("ORLHF_RM_TOKEN", "from-env")
    rewards = HttpReward(server.url, token="s3cret").score(QUERIES, PROMPTS, LABELS)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [float(len(q)) for q in QUERIES]
    body, auth = server.requests[0]
    assert body == {"query": QUERIES, "prompts": PROMPTS, "labels": ["colors", ""]} and auth == "Bearer s3cret"
    HttpReward(server.url).score(QUERIES, PROMPTS, LABELS)  # no token given: taken from $ORLHF_RM_TOKEN
    assert server.requests[1][1] == "Bearer from-env"


def test_http_reward_accepts_a_bare_list(serve):
    server = serve(lambda n, body: (200, [0.25, 0.75]))
    assert HttpReward(server.url).score(QUERIES, PROMPTS, LABELS).tolist() == [0.25, 0.75]


def test_http_reward_retries_a_500_then_succeeds(serve):
    server = serve(lambda n, body: (500, {"error": "warming up"}) if n == 1 else length_rewards(n, body))
    rewards = HttpReward(server.url, backoff_s=0.01).score(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 2 and rewards.tolist() == [float(len(q)) for q in QUERIES]


def test_http_reward_server_down_retries_then_names_the_url():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there now
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    start = time.monotonic()
    with pytest.raises(RewardError) as e:
        HttpReward(url, retries=2, backoff_s=0.01, timeout_s=2).score(QUERIES, PROMPTS, LABELS)
    assert time.monotonic() - start < 5
    msg = str(e.value)
    assert f"--remote_rm_url {url}: no answer after 3 attempts" in msg and "ConnectionError" in msg
    assert "Check that the reward server is running" in msg


def test_http_reward_slow_server_times_out(serve):
    server = serve(lambda n, body: (time.sleep(1.5), length_rewards(n, body))[1])
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"no answer after 2 attempts \(timeout 0.2 s each\).*ReadTimeout"):
        HttpReward(server.url, timeout_s=0.2, retries=1, backoff_s=0.01).score(QUERIES, PROMPTS, LABELS)
    assert time.monotonic() - start < 1.5 and len(server.requests) == 2


def test_http_reward_client_errors_are_not_retried(serve):
    server = serve(lambda n, body: (401, {"error": "bad token"}))
    with pytest.raises(RewardError, match=r"HTTP 401: .*bad token.*check the token \(\$ORLHF_RM_TOKEN\)"):
        HttpReward(server.url, backoff_s=0.01).score(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 1


def test_http_reward_bad_answers_are_checked_like_files(serve):
    server = serve(lambda n, body: (200, {"rewards": [1.0]}))
    with pytest.raises(RewardError, match=r"--remote_rm_url http://127\.0\.0\.1:\d+/score returned shape \(1,\)"):
        HttpReward(server.url).score(QUERIES, PROMPTS, LABELS)


def test_reward_query_is_the_prompt_text_plus_the_decoded_response():
    """With a chat template the prompt text holds special tokens: queries[i] still starts with prompts[i]
    (decoding prompt + response with skip_special_tokens would drop them from the query only)."""
    from types import SimpleNamespace

    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.trainer.scoring import reward_inputs

    tok = load_tokenizer(str(ensure_demo().model))
    text = f"{tok.bos_token}user: say colors:\nassistant:"
    prompt = SimpleNamespace(text=text, label="colors")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    response = tok(" red blue", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rollout = SimpleNamespace(prompt_ids=ids, response_ids=response, prompt_index=0)
    queries, prompts, labels = reward_inputs(tok, [rollout], [prompt])
    assert prompts == [text] and labels == ["colors"]
    assert queries[0].startswith(text) and queries[0][len(text) :] == tok.decode(response, skip_special_tokens=True)
    old = tok.decode(ids + response, skip_special_tokens=True)
    assert not old.startswith(text)  # decoding prompt + response together drops the special tokens
