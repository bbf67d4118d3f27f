"""`orlhf serve-rm`: serve a reward_func file over HTTP in OpenRLHF's remote-RM format.

    POST /get_reward  {"query": [...], "prompts": [...], "labels": [...]}  ->  {"rewards": [...]}

It binds 127.0.0.1 unless told otherwise (a reward server is an open door for anyone who can reach it) and,
with a token (--token or $ORLHF_RM_TOKEN), answers 401 to requests without `Authorization: Bearer <token>`.
Rewards go through the same checks as in training (rewards.to_rewards): one finite number per query.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from orlhf.rewards import TOKEN_ENV, FunctionReward, RewardError

log = logging.getLogger(__name__)
MAX_BODY = 64 * 2**20  # a batch of queries, not a file upload


def make_server(reward_fn: str, host: str = "127.0.0.1", port: int = 5000,
                token: Optional[str] = None) -> ThreadingHTTPServer:
    """A ready (bound, not yet serving) server; port 0 picks a free one (server.server_address)."""
    source = FunctionReward(reward_fn)
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    lock = threading.Lock()  # user reward functions need not be thread-safe

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if token is not None:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return self._reply(401, {"error": "missing or wrong bearer token"})
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                return self._reply(400, {"error": f"body must be 1..{MAX_BODY} bytes of JSON"})
            try:
                body = json.loads(self.rfile.read(length))
                queries, prompts = body["query"], body.get("prompts") or [""] * len(body["query"])
                labels = body.get("labels") or [""] * len(queries)
            except (ValueError, KeyError, TypeError) as e:
                return self._reply(400, {"error": f'expected {{"query": [...], "prompts": [...], "labels": [...]}}: {e}'})
            try:
                with lock:
                    rewards = source.score(list(queries), list(prompts), list(labels))
            except RewardError as e:
                return self._reply(500, {"error": str(e)})
            self._reply(200, {"rewards": rewards.tolist()})

        def _reply(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("%s " + fmt, self.client_address[0], *args)

    return ThreadingHTTPServer((host, port), Handler)
