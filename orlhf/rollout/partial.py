"""--partial_rollout: one batch generated in segments, so that a weight sync can land between two of them.

    segment 0     engines.generate(prompts, at most S new tokens each): the batch's own requests and seeds
    between       between(): the caller may let a waiting weight sync run now (trainer/async_producer.py, SyncGate)
    segment s>0   every unfinished sample alone, on the engine that began it:
                  GenerationRequest(prompt + response so far, n=1, min(S, tokens it has left),
                                    continuation_seed(request_seed of its prompt, its sample number, s))
    until each sample stopped (EOS) or reached its cap (--generate_max_len, and --max_len minus its prompt).

With --agent_func_path an episode's turns are the segments (TurnGate): each turn is one engine call, and a waiting
sync runs once no engine call of the batch is in flight, before the next turn starts; a turn is not cut (so
--partial_rollout_tokens does not apply). Each action token keeps its turn's weight version.

S is --partial_rollout_tokens. Invariants: every token keeps the log-prob, the weight version and (--router_replay R3)
the routed experts it was sampled with
(Rollout.token_versions; Rollout.weight_version is the oldest of them, so staleness and the sync guard see a mixed
sample as stale); a sample that stopped is never sent again; rollouts come back in the batch's order (prompt, then
sample). A continuation prefills its whole prefix again: after a sync the engines' prefix cache is empty
(rollout/weight_sync.py), so the new tokens are sampled from the new weights given the prefix, with no KV cache left
from the old ones (OpenRLHF's vLLM pause/resume keeps the old cache instead). Where the syncs fall depends on timing,
so a run is not reproducible step for step.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from orlhf.types import GenerationRequest, Rollout, SamplingSpec, continuation_seed, max_new_tokens, request_seed

if TYPE_CHECKING:
    from concurrent.futures import Future

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One sample of the batch as it grows, segment by segment."""

    rollout: Rollout  # prompt_ids: the prompt alone; response_ids, logprobs: everything sampled so far
    number: int  # its number among its prompt's samples (0 .. n-1)
    cap: int  # most new tokens it may have
    versions: list[int] = field(default_factory=list)  # (R,) weight version of each response token
    done: bool = False  # stopped (EOS) or at its cap

    @property
    def left(self) -> int:
        return self.cap - len(self.rollout.response_ids)


def start(rollouts: list[Rollout], sampling: SamplingSpec) -> list[Sample]:
    """The first segment's rollouts (prompt-major, as engines.generate returns them) -> the batch's samples."""
    counts: dict[int, int] = {}
    samples = []
    for r in rollouts:
        number = counts.get(r.prompt_index, 0)
        counts[r.prompt_index] = number + 1
        sample = Sample(replace(r, token_versions=None), number, max_new_tokens(sampling, len(r.prompt_ids)))
        sample.versions = [r.weight_version] * len(r.response_ids)
        sample.done = _done(sample, r)
        samples.append(sample)
    return samples


def continuations(samples: list[Sample], sampling: SamplingSpec, segment: int, tokens: int) -> dict[int, list]:
    """{engine: [GenerationRequest]} for the unfinished samples' segment number `segment` (>= 1), at most `tokens`
    new tokens each; a request's key is the sample's row in the batch."""
    out: dict[int, list[GenerationRequest]] = {}
    for row, s in enumerate(samples):
        if s.done:
            continue
        r = s.rollout
        seed = continuation_seed(request_seed(sampling.seed, r.prompt_index), s.number, segment)
        request = GenerationRequest(row, [*r.prompt_ids, *r.response_ids], 1, min(tokens, s.left), seed)
        out.setdefault(r.engine, []).append(request)
    return out


def extend(sample: Sample, part: Rollout) -> None:
    """Append a continuation's tokens, log-probs, weight version and routed experts to its sample."""
    r = sample.rollout
    r.routed_experts = merge_routing(r.routed_experts, part.routed_experts)
    r.response_ids = [*r.response_ids, *part.response_ids]
    r.logprobs = [*r.logprobs, *part.logprobs]
    sample.versions += [part.weight_version] * len(part.response_ids)
    sample.done = _done(sample, part) or not part.response_ids  # no token and no stop: nothing more will come
    r.finished = part.finished


def merge_routing(old: Optional[torch.Tensor], new: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """--router_replay R3: the routed experts (Rollout.routed_experts) of one token sequence that a later engine call
    ran again and grew: the earlier rows where both have them (the routing its tokens were sampled under), the
    later call's beyond."""
    if old is None or new is None:
        return new if old is None else old
    return torch.cat([old, new[old.shape[0] :]])


def grow_routing(held_ids: list[int], held, ids: list[int], rows) -> tuple[list[int], Optional[torch.Tensor]]:
    """An agent's episode: (ids, their rows) after a turn whose engine call ran `ids` and routed them as `rows` (None:
    only cut to `ids`). The held rows stay where the held tokens agree with `ids` (the routing the tokens were
    sampled under), the turn's rows cover the rest; a custom executor that rewrote earlier tokens loses the rows
    of what it rewrote."""
    same = 0
    for a, b in zip(held_ids, ids):
        if a != b:
            break
        same += 1
    kept = None if held is None else held[: min(same, held.shape[0])]
    return list(ids), merge_routing(kept, rows) if rows is not None else kept


def finish(samples: list[Sample]) -> list[Rollout]:
    """The batch's rollouts: token_versions set, weight_version the oldest token's (the first segment's engine
    version when a response is empty)."""
    out = []
    for s in samples:
        oldest = min(s.versions, default=s.rollout.weight_version)
        out.append(replace(s.rollout, token_versions=list(s.versions), weight_version=oldest))
    return out


def _done(sample: Sample, part: Rollout) -> bool:
    return part.finished or sample.left <= 0


class PartialGenerator:
    """A batch in segments of at most `tokens` new tokens per sample (module docstring). `engines`: an EngineGroup
    (generate, generate_requests); `between`: called before every segment after the first, from the thread that
    generates (the producer sets it to let a waiting weight sync run)."""

    def __init__(self, engines, tokens: int, between: Optional[Callable[[], object]] = None):
        self.engines, self.tokens = engines, tokens
        self.between = between or (lambda: None)
        self.segments = 0  # engine calls of the last batch
        log.info(
            "--partial_rollout: at most %d new tokens per sample in one engine call (--partial_rollout_tokens); a "
            "weight sync waits for one such call, and the unfinished samples go on under the new weights",
            tokens,
        )

    def generate(self, prompts: list, sampling: SamplingSpec) -> list[Rollout]:
        first = replace(sampling, max_new_tokens=min(self.tokens, sampling.max_new_tokens))
        samples = start(self.engines.generate([q.ids for q in prompts], first), sampling)
        self.segments = 1
        while not all(s.done for s in samples):
            self.between()
            requests = continuations(samples, sampling, self.segments, self.tokens)
            for part in self.engines.generate_requests(requests, sampling):
                extend(samples[part.prompt_index], part)
            self.segments += 1
        return finish(samples)


def segmenter(executor, engines, ppo, agent_func_path: Optional[str]):
    """--partial_rollout: what generates a batch in segments and lets a sync in between two (its `between`): the
    agents' runner itself (rollout/executor.py AgentRunner: its turns, TurnGate), else a PartialGenerator; None
    without --partial_rollout."""
    if not ppo.partial_rollout:
        return None
    return executor if agent_func_path else PartialGenerator(engines, ppo.partial_rollout_segment)


def version_stats(rollouts: list[Rollout], trainer_version: int) -> dict[str, float]:
    """Per-token staleness (trainer version - the version each token was sampled with: mean and max over the batch's
    response tokens) and the share of samples whose tokens come from more than one version (they crossed a sync)."""
    ages = [trainer_version - v for r in rollouts for v in (r.token_versions or [])]
    crossed = sum(len(set(r.token_versions or ())) > 1 for r in rollouts)
    return {
        "token_staleness_mean": sum(ages) / len(ages) if ages else 0.0,
        "token_staleness_max": float(max(ages, default=0)),
        "crossed_sync_frac": crossed / len(rollouts) if rollouts else 0.0,
    }


class TurnGate:
    """--partial_rollout with agents: the episodes' engine calls go through `call`; when a weight sync is waiting
    (`waiting()`), no new call starts, and once none is in flight `between()` lets the sync run (it blocks the
    episodes' event loop meanwhile). Without a waiting sync, calls start as they come (one per engine at a time,
    rollout/executor.py's EngineClient)."""

    def __init__(self, between: Optional[Callable[[], object]] = None, waiting: Callable[[], bool] = lambda: False):
        self.between, self.waiting = between, waiting
        self.in_flight = 0
        self._idle: Optional[asyncio.Event] = None  # made in the episodes' loop

    async def call(self, start: Callable[[], "Future"]) -> object:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        while self.between is not None and self.waiting():
            if self.in_flight == 0:
                self.between()  # nothing in flight: the sync runs now, and has run when this returns
                break
            await self._idle.wait()
        self.in_flight += 1
        self._idle.clear()
        try:
            return await asyncio.wrap_future(start())
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()


def turn_versions(action_ranges: list[tuple[int, int]], start: int, length: int, versions: list[int]) -> list[int]:
    """(R,) weight version of each response token of an agent episode: an action range's tokens have the version of
    the turn that sampled it, a feedback token that of the turn before it. `start`: where the response begins in the
    episode's tokens; `versions`: one per turn, in order. Needs one action range per turn (the executor's contract
    with MultiTurnAgentExecutor); otherwise every token gets the oldest version."""
    if len(action_ranges) != len(versions) or not versions:
        return [min(versions, default=0)] * length
    out = [versions[0]] * length
    for (s, _), v in zip(action_ranges, versions):  # each turn's version from its action's first token on
        out[s - start :] = [v] * (length - (s - start))
    return out
