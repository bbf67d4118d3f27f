"""Reward sources besides a reward model: a python file's reward_func, or a remote HTTP reward server.

    queries (prompt + response text), prompts, labels --RewardSource.score()--> rewards: torch.float32 (B,)
                                                      --RewardSource.evaluate()--> RewardResult
                                                          .rewards (B,) train on these
                                                          .scores (B,) for dynamic filtering (default: rewards)
                                                          .extra_logs {name: (B,)} logged as reward/<name> means

--remote_rm_url picks the source (make_reward_source): http(s)://... -> HttpReward, a .py file -> FunctionReward.
The reward-model group (--reward_pretrain) is wrapped to the same interface by the controller.

Contract, as OpenRLHF's: queries[i] is the decoded prompt + response of sample i, prompts[i] the decoded prompt
(so queries[i][len(prompts[i]):] is the response), labels[i] the --label_key value, "" when there is none (None
labels become "", as OpenRLHF's dataset gives ""). Whatever a source answers is checked the same way
(to_result): one finite number per query, else a RewardError naming the source and the bad indices, because a
NaN reward silently poisons every advantage of the step. A source may answer OpenRLHF's dict
{"rewards", "scores", "extra_logs"}; each part is checked alike.

A python file's reward_func runs in this process, in a daemon thread with a deadline (--reward_timeout_s): a
stuck function fails the run with a RewardError naming the file instead of hanging it. The stuck call cannot be
killed; until it returns, no other call of that reward_func starts (RewardBusy), as it need not be thread-safe.
What it prints goes to the run's logs/reward_func.log, not the terminal (user_output.py).
An HTTP server gets the same deadline for each batch, all its retries (--reward_retries) together
(inputs/http_reward.py).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from orlhf.inputs.user_files import NotImportable, import_failure, import_file, user_frames
from orlhf.inputs.user_output import captured_output

logger = logging.getLogger(__name__)

TOKEN_ENV = "ORLHF_RM_TOKEN"


class RewardError(RuntimeError):
    """A reward source failed or answered something unusable; the message names the source and the fix."""


class RewardBusy(RewardError):
    """A reward_func call that passed its deadline is still running: no second call starts beside it."""


@dataclass(frozen=True)
class RewardResult:
    """What a reward source answered for one batch of B queries, checked."""

    rewards: torch.Tensor  # float32 (B,): what PPO trains on
    scores: torch.Tensor  # float32 (B,): what dynamic filtering compares (OpenRLHF: rewards unless given)
    extra_logs: dict[str, torch.Tensor] = field(default_factory=dict)  # float32 (B,) each: logged, not trained

    @classmethod
    def of(cls, rewards: torch.Tensor) -> "RewardResult":
        return cls(rewards=rewards, scores=rewards)

    def rows(self, start: int, stop: int) -> "RewardResult":
        """Rows start:stop of every field (one prompt's group of samples, for dynamic filtering)."""
        return RewardResult(
            self.rewards[start:stop], self.scores[start:stop], {k: v[start:stop] for k, v in self.extra_logs.items()}
        )

    @classmethod
    def cat(cls, parts: list["RewardResult"]) -> "RewardResult":
        """Rows of several results, in order (the same extra_logs keys in each)."""
        keys = parts[0].extra_logs.keys()
        return cls(
            torch.cat([p.rewards for p in parts]),
            torch.cat([p.scores for p in parts]),
            {k: torch.cat([p.extra_logs[k] for p in parts]) for k in keys},
        )

    def log_row(self) -> dict[str, float]:
        """extra_logs as metrics: the batch mean of each, under reward/<name>."""
        return {f"reward/{k}": v.mean().item() for k, v in self.extra_logs.items()}


@runtime_checkable
class RewardSource(Protocol):
    def score(self, queries: list[str], prompts: list[str], labels: list) -> torch.Tensor:
        """One float32 reward per query, shape (B,)."""
        ...

    def evaluate(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        """Rewards, scores and extra logs, shape (B,) each."""
        ...


def make_reward_source(
    remote_rm_url: str, timeout_s: float = 300.0, retries: int = 5, output_log: str | os.PathLike | None = None
) -> RewardSource:
    """--remote_rm_url -> its source: http(s)://host:port/path -> HttpReward, path/to/file.py -> FunctionReward.
    timeout_s: --reward_timeout_s, the deadline of one reward_func call or of one HTTP request with its retries;
    retries: --reward_retries (HTTP); output_log: where a reward_func's prints go (None: the terminal)."""
    if remote_rm_url.startswith(("http://", "https://")):
        from orlhf.inputs.http_reward import HttpReward

        return HttpReward(remote_rm_url, timeout_s=timeout_s, retries=retries)
    if remote_rm_url.endswith(".py"):
        return FunctionReward(remote_rm_url, timeout_s=timeout_s, output_log=output_log)
    raise RewardError(
        f"--remote_rm_url {remote_rm_url}: expected an http(s)://host:port/path URL or a .py file defining reward_func."
    )


# ---- Checking what a source answers ----


def to_rewards(out: Any, n: int, source: str) -> torch.Tensor:
    """A source's answer -> its float32 (n,) rewards (see to_result)."""
    return to_result(out, n, source).rewards


def to_result(out: Any, n: int, source: str) -> RewardResult:
    """A source's answer -> RewardResult. Accepts a tensor, list, numpy array, or a dict with "rewards" and
    optionally "scores" (n values) and "extra_logs" ({name: n values or one number}), OpenRLHF's answer; shape
    (n, 1) is flattened. Raises RewardError naming the source and the part otherwise."""
    if not isinstance(out, dict):
        return RewardResult.of(_to_vector(out, n, source))
    if "rewards" not in out:
        raise RewardError(
            f"{source} returned a dict without 'rewards' (keys: {sorted(map(str, out))}); "
            "return {'rewards': [...]} or the rewards themselves."
        )
    rewards = _to_vector(out["rewards"], n, f"{source} ['rewards']")
    scores = rewards if out.get("scores") is None else _to_vector(out["scores"], n, f"{source} ['scores']")
    extra = out.get("extra_logs") or {}
    if not isinstance(extra, dict):
        raise RewardError(
            f"{source} returned 'extra_logs' as a {type(extra).__name__}; return a dict {{name: one number per query}}."
        )
    logs = {}
    for name, value in extra.items():
        where = f"{source} ['extra_logs'][{name!r}]"
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            value = [float(value)] * n  # one number for the batch
        logs[str(name)] = _to_vector(value, n, where)
    return RewardResult(rewards=rewards, scores=scores, extra_logs=logs)


def _to_vector(out: Any, n: int, source: str) -> torch.Tensor:
    """Numbers -> float32 (n,), finite, or a RewardError naming `source`."""
    try:
        if isinstance(out, torch.Tensor):
            rewards = out.detach().to("cpu", torch.float32)
        else:
            rewards = torch.as_tensor(out, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise RewardError(
            f"{source} returned non-numeric rewards ({type(out).__name__}: {_preview(out)}): {e}; "
            f"return {n} floats, one per query."
        ) from None
    if rewards.dim() == 2 and rewards.shape[1] == 1:
        rewards = rewards[:, 0]  # (B, 1) -> (B,): a reward model's value-head layout
    if tuple(rewards.shape) != (n,):
        raise RewardError(
            f"{source} returned shape {tuple(rewards.shape)} for {n} queries; return one reward "
            f"per query, shape ({n},)."
        )
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"{i}: {rewards[i].item()}" for i in bad[:10])
        raise RewardError(
            f"{source} returned {len(bad)} non-finite rewards (NaN/inf) at indices {bad[:10]}"
            f"{' ...' if len(bad) > 10 else ''} ({shown}); rewards must be finite numbers."
        )
    return rewards.contiguous()


def _preview(out: Any) -> str:
    text = repr(out)
    return text if len(text) <= 80 else text[:77] + "..."


def check_batch(queries: list[str], prompts: list[str], labels: list) -> list:
    """Caller-side checks (a mismatch is an orlhf bug, not the user's); returns labels with None as ""."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"{len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels; need one each")
    return ["" if label is None else label for label in labels]


# ---- A python file's reward_func ----


class FunctionReward:
    """reward_func(queries, prompts, labels) from a .py file, run in this process (see orlhf/demo/reward.py).

    What it prints goes to `output_log` (the run's logs/reward_func.log; user_output.py), and each call that printed
    says how many lines in one terminal line; None leaves its output on the terminal (--verbose, `orlhf serve-rm`).
    """

    def __init__(self, path: str | os.PathLike, timeout_s: float = 300.0, output_log: str | os.PathLike | None = None):
        self.path, self.timeout_s, self.output_log = str(Path(path).expanduser()), timeout_s, output_log
        self._func = _load_reward_func(self.path)
        self._abandoned: Optional[threading.Thread] = None  # a call past its deadline (it may still run)

    def score(self, queries: list[str], prompts: list[str], labels: list) -> torch.Tensor:
        return self.evaluate(queries, prompts, labels).rewards

    def evaluate(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        labels = check_batch(queries, prompts, labels)
        out = self._call_with_deadline(list(queries), list(prompts), labels)
        return to_result(out, len(queries), f"{self.path}: reward_func")

    def _call_with_deadline(self, *args) -> Any:
        """reward_func(*args) in a daemon thread; past timeout_s, a RewardError (the thread is abandoned: python
        cannot kill it, and a daemon thread does not keep the process alive). While an abandoned call still
        runs, RewardBusy: a second call beside it would break a reward_func that is not thread-safe."""
        if self._abandoned is not None and self._abandoned.is_alive():
            raise RewardBusy(
                f"{self.path}: the previous reward_func call ran past --reward_timeout_s "
                f"{self.timeout_s:g} s and has not returned yet; no other call starts beside it."
            )
        box: dict[str, Any] = {}

        def run() -> None:
            with captured_output(self.output_log) as printed:
                try:
                    box["out"] = self._func(*args)
                except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
                    box["error"] = e
            if printed.lines:
                logger.info("reward_func printed %d line(s) -> %s", printed.lines, printed.path)

        worker = threading.Thread(target=run, name="orlhf-reward-func", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self._abandoned = worker
            raise RewardError(
                f"{self.path}: reward_func did not return within {self.timeout_s:g} s "
                f"(--reward_timeout_s) for a batch of {len(args[0])} queries. Fix what it waits on "
                f"in {self.path} (a network call, a lock, an endless loop), or raise "
                "--reward_timeout_s if it is just slow."
            )
        e = box.get("error")
        if e is not None:
            if isinstance(e, KeyboardInterrupt):
                raise e  # an interrupt still interrupts the run
            # sys.exit() in reward_func would otherwise end the run with its code and no word: it is the function's
            # error like any other.
            what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
            raise RewardError(
                f"{self.path}: reward_func {what}\n{user_frames(e, self.path)}\nFix reward_func in {self.path}."
            ) from e
        return box.get("out")

    def __reduce__(self):
        # Sent to a Ray actor by path, and imported again there: a module loaded from a file does not pickle. The
        # output log stays behind: an actor's own output already goes to its log file.
        return (FunctionReward, (self.path, self.timeout_s))


def _load_reward_func(path: str):
    if not Path(path).is_file():
        raise RewardError(f"--remote_rm_url {path}: no such file; pass a .py file that defines reward_func.")
    try:
        module = import_file(path, "orlhf_reward")
    except NotImportable:
        raise RewardError(
            f"{path}: python cannot import this file; pass a .py file that defines reward_func."
        ) from None
    except (Exception, SystemExit) as e:
        raise RewardError(f"{import_failure(e, path)}\nFix the file (`python {path}` shows the full error).") from e
    func = getattr(module, "reward_func", None)
    if func is None:
        raise RewardError(
            f"{path} defines no reward_func; define `def reward_func(queries, prompts, labels)` "
            "returning one float per query (a torch.Tensor of shape (B,)); see orlhf/demo/reward.py."
        )
    if not callable(func):
        raise RewardError(
            f"{path}: reward_func is a {type(func).__name__}, not a function; define "
            "`def reward_func(queries, prompts, labels)`."
        )
    return func
