"""Reward sources: a python reward file and an HTTP reward server, and the errors that name what went wrong."""

import json
import logging
import pickle
import socket
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from orlhf.demo.builder import ensure_demo
from orlhf.inputs.http_reward import HttpReward
from orlhf.inputs.rewards import FunctionReward, RewardBusy, RewardError, RewardSource, make_reward_source, to_rewards
from orlhf.inputs.user_output import ThreadRouter, captured_output

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


def test_what_reward_func_prints_goes_to_the_log_file_with_a_count_on_the_terminal(tmp_path, capsys, caplog):
    path = reward_file(
        tmp_path,
        """
        import sys
        def reward_func(queries, prompts, labels):
            for i in range(1000):
                print("scoring", i)
            sys.stderr.write("a warning of its own\\n")
            sys.stdout.write("no newline at the end")
            return [1.0] * len(queries)
    """,
    )
    log = tmp_path / "logs" / "reward_func.log"
    source = make_reward_source(path, output_log=log)
    with caplog.at_level(logging.INFO, logger="orlhf"):
        assert source.score(QUERIES, PROMPTS, LABELS).tolist() == [1.0, 1.0]
        assert source.score(QUERIES, PROMPTS, LABELS).tolist() == [1.0, 1.0]
    out, err = capsys.readouterr()
    # none of it on the terminal (only orlhf's own count line, where a handler of the "orlhf" logger writes there)
    assert "scoring" not in out + err and "a warning of its own" not in out + err and "no newline" not in out + err
    text = log.read_text()
    assert text.count("scoring 999\n") == 2 and "a warning of its own\n" in text and text.count("\n") == 2004
    assert "no newline at the end\nscoring 0\n" in text  # each call's output starts a line
    lines = [r.getMessage() for r in caplog.records if "printed" in r.getMessage()]
    assert lines == [f"reward_func printed 1002 line(s) -> {log}"] * 2
    assert not isinstance(sys.stdout, ThreadRouter) and not isinstance(sys.stderr, ThreadRouter)  # put back


def test_only_the_capturing_thread_is_routed(tmp_path, capsys):
    """orlhf's own lines (the progress bar, the log) printed by other threads meanwhile stay on the terminal."""
    inside, done = threading.Event(), threading.Event()

    def user_code():
        with captured_output(tmp_path / "user.log") as printed:
            print("from user code")
            inside.set()
            done.wait(5)
        assert printed.lines == 1

    worker = threading.Thread(target=user_code)
    worker.start()
    assert inside.wait(5)
    print("from orlhf")
    done.set()
    worker.join(5)
    assert capsys.readouterr().out == "from orlhf\n"
    assert (tmp_path / "user.log").read_text() == "from user code\n"
    with captured_output(None) as printed:  # no log folder (--verbose): the terminal keeps it
        print("shown")
    assert printed.lines == 0 and capsys.readouterr().out == "shown\n"


def test_the_run_builds_its_reward_source_from_the_flags(tmp_path, monkeypatch):
    from orlhf.config.flags import build_config
    from orlhf.launch.run_inputs import make_reward

    flags = {"remote_rm_url": "http://127.0.0.1:1/score", "reward_timeout_s": 7.0, "reward_retries": 0}
    source = make_reward(build_config(flags, set(flags)))
    assert isinstance(source, HttpReward) and (source.timeout_s, source.retries) == (7.0, 0)
    monkeypatch.setenv("ORLHF_LOG_DIR", str(tmp_path))
    flags = {"remote_rm_url": str(ensure_demo().reward_fn), "reward_timeout_s": 9.0}
    source = make_reward(build_config(flags, set(flags)))
    assert isinstance(source, FunctionReward) and source.timeout_s == 9.0
    assert source.output_log == tmp_path / "reward_func.log"


def test_to_rewards_lists_at_most_ten_bad_indices():
    with pytest.raises(RewardError, match=r"12 non-finite .* indices \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\] \.\.\."):
        to_rewards(torch.full((12,), float("nan")), 12, "src")


def test_make_reward_source_rejects_other_values():
    with pytest.raises(RewardError, match=r"--remote_rm_url ftp://x: expected an http\(s\)://"):
        make_reward_source("ftp://x")
    assert isinstance(make_reward_source("http://127.0.0.1:1/score"), HttpReward)


# ---- HttpReward against a local server ----


class RewardServer:
    """A tiny HTTP reward server on 127.0.0.1 (random port). `behave(n, body)` -> (status, answer) per request n:
    answer as JSON, or bytes sent as they are; None closes the connection without an answer."""

    def __init__(self, behave):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((body, self.headers.get("Authorization")))
                reply = behave(len(server.requests), body)
                if reply is None:
                    return  # no answer: the server closes the connection
                status, answer = reply
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
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
    assert f"--remote_rm_url {url}: no answer after 3 attempt(s) (--reward_retries 2)" in msg
    assert "last error: ConnectionError: [Errno 111] Connection refused" in msg and "\n" not in msg
    assert "Check that the reward server is running" in msg


def test_http_reward_server_dropping_its_first_two_connections_still_scores(serve):
    server = serve(lambda n, body: None if n <= 2 else length_rewards(n, body))
    rewards = HttpReward(server.url, timeout_s=10, retries=2, backoff_s=0.01).score(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 3 and rewards.tolist() == [float(len(q)) for q in QUERIES]


def test_http_reward_server_that_never_answers_stops_within_the_deadline(serve):
    """--reward_timeout_s bounds a batch's request with all its retries (--reward_retries), as the flags set it."""
    release = threading.Event()
    server = serve(lambda n, body: (release.wait(10), length_rewards(n, body))[1])
    source = make_reward_source(server.url, timeout_s=1.0, retries=5)
    start = time.monotonic()
    try:
        with pytest.raises(RewardError) as e:
            source.score(QUERIES, PROMPTS, LABELS)
    finally:
        release.set()
    assert time.monotonic() - start < 2.5
    msg = str(e.value)
    assert msg.startswith(f"--remote_rm_url {server.url}: no answer within 1 s (--reward_timeout_s, 1 attempt(s))")
    assert "last error: ReadTimeout" in msg and "\n" not in msg


def test_http_reward_retries_until_the_deadline_then_names_the_last_error(serve):
    server = serve(lambda n, body: (503, {"error": "busy: retry later"}))
    start = time.monotonic()
    with pytest.raises(
        RewardError,
        match=r"no answer within 0.5 s \(--reward_timeout_s, \d attempt\(s\)\); last "
        r"error: HTTP 503: \{\"error\": \"busy: retry later\"\}",
    ):
        HttpReward(server.url, timeout_s=0.5, retries=100, backoff_s=0.05).score(QUERIES, PROMPTS, LABELS)
    assert time.monotonic() - start < 1.5 and 2 <= len(server.requests) < 10


@pytest.mark.parametrize(
    "answer, problem",
    [
        (b'{"rewards": [1.0, ', r"the answer is not JSON \(.*\): '\{\"rewards\": \[1\.0, '\)"),
        ({"reward": [1.0, 2.0]}, r"returned a dict without 'rewards' \(keys: \['reward'\]\)"),
        ({"rewards": ["high", "low"]}, r"\['rewards'\] returned non-numeric rewards"),
        (
            {"rewards": [1.0, 2.0], "scores": None, "extra_logs": {"acc": [1]}},
            r"\['extra_logs'\]\['acc'\] returned shape",
        ),
        (b"<html>\n<body>oops</body>\n</html>", r"the answer is not JSON"),
    ],
)
def test_http_reward_malformed_answers_are_one_line_naming_the_field(serve, answer, problem):
    server = serve(lambda n, body: (200, answer))
    with pytest.raises(RewardError, match=f"^--remote_rm_url {server.url}.*{problem}") as e:
        HttpReward(server.url, backoff_s=0.01).score(QUERIES, PROMPTS, LABELS)
    assert "\n" not in str(e.value) and len(server.requests) == 1  # the server's fault: no retry


def test_http_reward_client_errors_are_not_retried(serve):
    server = serve(lambda n, body: (401, {"error": "bad token"}))
    with pytest.raises(RewardError, match=r"HTTP 401: .*bad token.*check the token \(\$ORLHF_RM_TOKEN\)"):
        HttpReward(server.url, backoff_s=0.01).score(QUERIES, PROMPTS, LABELS)
    assert len(server.requests) == 1


def test_http_reward_bad_answers_are_checked_like_files(serve):
    server = serve(lambda n, body: (200, {"rewards": [1.0]}))
    with pytest.raises(
        RewardError, match=r"--remote_rm_url http://127\.0\.0\.1:\d+/score \['rewards'\] returned shape \(1,\)"
    ):
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
