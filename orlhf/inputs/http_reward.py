"""The remote HTTP reward source (--remote_rm_url http(s)://...): OpenRLHF's remote reward-model client.

Its answers are checked as every source's are (inputs/rewards.py to_result); the server side is
inputs/reward_server.py (`orlhf serve-rm`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

import torch

from orlhf.inputs.rewards import TOKEN_ENV, RewardError, RewardResult, check_batch, to_result

logger = logging.getLogger(__name__)


class HttpReward:
    """POSTs {"query", "prompts", "labels"} (OpenRLHF's remote RM format); accepts {"rewards": [...]} or a list.

    One batch gets `timeout_s` (--reward_timeout_s) for all its attempts together: connection errors, timeouts and
    5xx answers are retried up to `retries` times (--reward_retries; 0: one attempt), after backoff_s, 2*backoff_s,
    4*backoff_s... (at most MAX_BACKOFF_S), while the deadline allows; a reward server restarting should not kill a
    long run, and one that never answers stops it within the deadline, naming the URL and the last error. 4xx and
    malformed answers are not retried (the request or the server is wrong): one line naming what is wrong. The
    bearer token comes from `token`, else $ORLHF_RM_TOKEN.
    """

    MAX_BACKOFF_S = 30.0

    def __init__(
        self, url: str, timeout_s: float = 300.0, retries: int = 5, backoff_s: float = 1.0, token: str | None = None
    ):
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)

    def score(self, queries: list[str], prompts: list[str], labels: list) -> torch.Tensor:
        return self.evaluate(queries, prompts, labels).rewards

    def evaluate(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        labels = check_batch(queries, prompts, labels)
        try:
            body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": labels})
        except (TypeError, ValueError) as e:
            raise RewardError(
                f"--remote_rm_url {self.url}: the labels cannot be sent as JSON ({e}); use "
                "JSON-compatible values in the --label_key field."
            ) from None
        return to_result(self._post(body), len(queries), f"--remote_rm_url {self.url}")

    def _post(self, body: str) -> Any:
        import requests

        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.timeout_s
        attempts, last = 0, ""
        while True:
            left = max(deadline - time.monotonic(), 1e-3)  # each attempt waits at most for what the deadline leaves
            try:
                resp = requests.post(self.url, data=body.encode(), headers=headers, timeout=left)
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                last = _error_text(e)
            else:
                if resp.status_code < 500:
                    return self._answer(resp)
                last = f"HTTP {resp.status_code}: {_one_line(resp.text, 200)}"
            attempts += 1
            wait = min(self.backoff_s * 2 ** (attempts - 1), self.MAX_BACKOFF_S)
            if attempts > self.retries or time.monotonic() + wait >= deadline:
                break
            logger.warning(
                "reward server %s: attempt %d of %d failed (%s); retrying in %g s",
                self.url,
                attempts,
                1 + self.retries,
                last,
                wait,
            )
            time.sleep(wait)
        why = (
            f"no answer after {attempts} attempt(s) (--reward_retries {self.retries})"
            if attempts > self.retries
            else f"no answer within {self.timeout_s:g} s (--reward_timeout_s, {attempts} attempt(s))"
        )
        raise RewardError(
            f"--remote_rm_url {self.url}: {why}; last error: {last}. Check that the reward server is running "
            "and reachable from here, or fix --remote_rm_url."
        )

    def _answer(self, resp) -> Any:
        if resp.status_code >= 400:
            hint = (
                f"check the token (${TOKEN_ENV})"
                if resp.status_code in (401, 403)
                else 'check that the server takes OpenRLHF\'s {"query", "prompts", "labels"} JSON'
            )
            raise RewardError(
                f"--remote_rm_url {self.url}: HTTP {resp.status_code}: {_one_line(resp.text, 300)}; {hint}."
            )
        try:
            return resp.json()
        except ValueError as e:
            raise RewardError(
                f"--remote_rm_url {self.url}: the answer is not JSON ({_one_line(str(e), 100)}: "
                f'{resp.text[:200]!r}); the server must answer {{"rewards": [...]}} or a JSON list.'
            ) from None


def _one_line(text: str, limit: int) -> str:
    """A server's text (an HTML error page, say) as one line of at most `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_text(e: Exception) -> str:
    """A requests error in one line: its type and the OS's reason when there is one ("[Errno 111] Connection
    refused"), not urllib3's nested reprs."""
    text = str(e)
    errno = re.search(r"\[Errno -?\d+\][^'\")\]]*", text)
    return f"{type(e).__name__}: {_one_line(errno.group(0) if errno else text, 200)}"
