"""`orlhf serve-rm`: serve a reward_func file over HTTP in OpenRLHF's remote-RM format.

    POST /get_reward  {"query": [...], "prompts": [...], "labels": [...]}  ->  {"rewards": [...]}
                                                       (+ "scores", "extra_logs" when reward_func returns them)

It binds 127.0.0.1 unless told otherwise, and refuses any other address without a token (--token or
$ORLHF_RM_TOKEN): a reward server is an open door for anyone who can reach it. With a token it answers 401 to
requests without `Authorization: Bearer <token>`.

Every request ends in an answer or a closed socket within bounds:
- at most `workers` connections are handled at once (a bounded pool); the next ones wait in the listen backlog
  instead of each pinning a thread;
- one request per connection, read against one deadline: request line, headers and body must all arrive within
  `timeout_s` of the connection being accepted (a client sending a byte at a time cannot stretch it, as it could a
  per-read socket timeout). Past it: 408 once any byte arrived (a body shorter than its Content-Length included),
  else the connection is just closed;
- after a reward_func call passes `reward_timeout_s` (500) it keeps running (a thread cannot be killed); until it
  returns, requests get 503 "busy: ..." instead of a second call beside it (reward_func need not be
  thread-safe). Clients retry a 503 (http_reward.HttpReward does, with backoff);
- every malformed request gets 400 with a one-line reason (bad Content-Length, not JSON, missing "query", a field
  that is not a list of strings, lists of different lengths); a reward_func failure gets 500 with its message.
Rewards go through the same checks as in training (rewards.to_result): one finite number per query.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Optional

from orlhf.inputs.rewards import TOKEN_ENV, FunctionReward, RewardBusy, RewardError

log = logging.getLogger(__name__)
MAX_BODY = 64 * 2**20  # a batch of queries, not a file upload


class BadRequest(ValueError):
    """A malformed request: answered 400 with this message (one line)."""


class DeadlineReader(io.RawIOBase):
    """A connection's reads against one deadline: each recv waits at most for the time left, so the deadline bounds
    the whole request however the client spaces its bytes. Past it, TimeoutError (and `expired`)."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.deadline = sock, time.monotonic() + seconds
        self.received, self.expired = 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("request deadline passed")
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buf)
        except TimeoutError:
            self.expired = True
            raise
        self.received += n
        return n


class PooledHTTPServer(HTTPServer):
    """HTTPServer whose connections run on a fixed pool of threads: `workers` at once, the rest wait unaccepted
    (a semaphore gates accept), so idle clients cannot grow the thread count."""

    request_queue_size = 128  # connections waiting for a free worker
    service: Optional["RewardService"] = None  # what RewardHandler serves (make_server sets it)

    def __init__(self, address, handler, workers: int):
        self._slots = threading.BoundedSemaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="orlhf-rm")
        super().__init__(address, handler)

    def _handle_request_noblock(self) -> None:
        self._slots.acquire()  # blocks serve_forever's loop (not a worker) until a thread is free
        try:
            request, client = self.get_request()
        except OSError:
            self._slots.release()
            return
        self._pool.submit(self._work, request, client)

    def _work(self, request, client) -> None:
        try:
            self.finish_request(request, client)
        except Exception:  # noqa: BLE001 (one broken connection must not kill the server)
            self.handle_error(request, client)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class RewardService:
    """What every connection's handler shares: the reward function, the token and the deadlines."""

    source: FunctionReward
    token: Optional[str]
    timeout_s: float  # a whole request's deadline, and each write's socket timeout
    reward_timeout_s: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # user reward functions need not be thread-safe


def make_server(
    reward_fn: str,
    host: str = "127.0.0.1",
    port: int = 5000,
    token: Optional[str] = None,
    timeout_s: float = 30.0,
    workers: int = 8,
    reward_timeout_s: float = 300.0,
) -> PooledHTTPServer:
    """A ready (bound, not yet serving) server; port 0 picks a free one (server.server_address). Raises
    ValueError for a non-loopback host without a token."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"--host {host} exposes the reward server beyond this machine; give it a token "
            f"(--token, or ${TOKEN_ENV}) so only your trainer can call it, or bind 127.0.0.1."
        )
    service = RewardService(FunctionReward(reward_fn, timeout_s=reward_timeout_s), token, timeout_s, reward_timeout_s)
    server = PooledHTTPServer((host, port), RewardHandler, workers)
    server.service = service  # read by each RewardHandler through self.server
    return server


class RewardHandler(BaseHTTPRequestHandler):
    """One connection of a make_server server: one POST read against one deadline, answered once."""

    def setup(self) -> None:
        self.service: RewardService = self.server.service
        self.timeout = self.service.timeout_s  # socket timeout of each write; reads go through DeadlineReader
        super().setup()
        self.reader = DeadlineReader(self.connection, self.service.timeout_s)
        self.rfile = io.BufferedReader(self.reader)
        self.replied = False

    def handle_one_request(self) -> None:
        super().handle_one_request()  # catches a read's TimeoutError itself and closes without an answer
        if self.reader.expired and self.reader.received and not self.replied:  # request line or headers
            self.request_version = getattr(self, "request_version", "HTTP/1.0") or "HTTP/1.0"
            self.requestline = getattr(self, "requestline", "")
            try:
                self._reply(
                    408,
                    {
                        "error": f"request line and headers not received within {self.service.timeout_s:g} s "
                        "(--timeout_s covers the whole request)"
                    },
                )
            except OSError:  # the client is gone already: nobody to tell
                pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        token = self.service.token
        if token is not None:
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return self._reply(401, {"error": "missing or wrong bearer token"})
        try:
            queries, prompts, labels = parse_request(self.headers.get("Content-Length"), self.rfile)
        except BadRequest as e:
            return self._reply(400, {"error": str(e)})
        except socket.timeout:
            return self._reply(
                408,
                {
                    "error": f"body not received within {self.service.timeout_s:g} s (is Content-Length "
                    "larger than the body, or is it sent too slowly?)"
                },
            )
        self._score(queries, prompts, labels)

    def _score(self, queries: list[str], prompts: list[str], labels: list) -> None:
        """One reward_func call, answered 200 with its rewards, 503 while a timed-out call still runs, else 500."""
        try:
            with self.service.lock:
                result = self.service.source.evaluate(queries, prompts, labels)
        except RewardBusy:
            return self._reply(
                503,
                {
                    "error": "busy: the previous reward_func call has not returned (it ran past "
                    f"--reward_timeout_s {self.service.reward_timeout_s:g} s); retry later"
                },
            )
        except RewardError as e:
            return self._reply(500, {"error": str(e)})
        answer: dict[str, Any] = {"rewards": result.rewards.tolist(), "scores": result.scores.tolist()}
        if result.extra_logs:
            answer["extra_logs"] = {k: v.tolist() for k, v in result.extra_logs.items()}
        self._reply(200, answer)

    def _reply(self, code: int, obj: dict) -> None:
        self.replied = True
        self.connection.settimeout(self.service.timeout_s)  # the reads left it at what remained of their deadline
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def log_message(self, fmt: str, *args) -> None:
        log.debug("%s " + fmt, self.client_address[0], *args)


def parse_request(content_length: Optional[str], rfile) -> tuple[list[str], list[str], list]:
    """Content-Length + body -> (queries, prompts, labels), or BadRequest with a one-line reason. Missing prompts
    and labels default to "" per query (OpenRLHF's clients may leave them out)."""
    try:
        length = int(content_length or "")
    except ValueError:
        raise BadRequest(f"Content-Length must be a number of bytes (got {content_length!r})") from None
    if not 0 < length <= MAX_BODY:
        raise BadRequest(f"body must be 1..{MAX_BODY} bytes of JSON (Content-Length {length})")
    raw = rfile.read(length)
    if len(raw) < length:
        raise BadRequest(f"body ended after {len(raw)} of {length} bytes (Content-Length)")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON ({e})") from None
    if not isinstance(body, dict) or "query" not in body:
        raise BadRequest('expected a JSON object {"query": [...], "prompts": [...], "labels": [...]}')
    queries = body["query"]
    n = len(queries) if isinstance(queries, list) else 0
    prompts = body.get("prompts") if body.get("prompts") is not None else [""] * n
    labels = body.get("labels") if body.get("labels") is not None else [""] * n
    for name, value in (("query", queries), ("prompts", prompts)):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise BadRequest(f'"{name}" must be a list of strings (got {type(value).__name__})')
    if not isinstance(labels, list):
        raise BadRequest(f'"labels" must be a list (got {type(labels).__name__})')
    if not queries:
        raise BadRequest('"query" is empty; send at least one query')
    if not len(queries) == len(prompts) == len(labels):
        raise BadRequest(
            f'"query", "prompts" and "labels" must have the same length (got {len(queries)}, '
            f"{len(prompts)}, {len(labels)})"
        )
    return queries, prompts, labels
