"""What an agent executor sees as its `llm_engine` (rollout/executor.py AgentRunner runs the episodes): OpenRLHF's
llm_engine and vLLM's RequestOutput, as far as agents read them, over a client that batches many agents' turns into
one call of the rollout backend.

    EngineHandle.generate(ids, params) --queue--> EngineClient(member of the sample) --one call per batch-->
        RolloutBackend.generate_turns -> [TurnResult] -> RequestOutput for each agent

Invariant: sample j's turn t samples with a seed derived from (step seed, j, t) unless the agent sets one (turn_seed),
so a run is reproducible whatever the timing of the environments.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from orlhf.rollout.agent import AgentError, AgentStepError
from orlhf.rollout.partial import TurnGate, grow_routing
from orlhf.types import TurnResult

# ---- what an agent executor sees: OpenRLHF's llm_engine and vLLM's RequestOutput, as far as agents read them ----


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]]  # one {token id: Logprob} per generated token (the sampled one)
    finish_reason: Optional[str]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class EngineClient:
    """Batches many agents' one-turn requests into one call to one engine (see the module docstring).

    `call(requests)` starts an engine call and returns a concurrent.futures.Future of its results."""

    def __init__(self, call: Callable[[list], Any], gate: Optional[TurnGate] = None):
        self.call = call
        self.gate = gate or TurnGate()  # --partial_rollout: a waiting weight sync runs between two engine calls
        self.pending: list[tuple[list[int], Any, asyncio.Future]] = []
        self._wake = asyncio.Event()

    async def generate(self, ids: list[int], params) -> TurnResult:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((ids, params, fut))
        self._wake.set()
        return await fut

    async def serve(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # let every agent that is ready queue its request first
            batch, self.pending = self.pending, []
            if not batch:
                continue
            try:
                results = await self.gate.call(functools.partial(self.call, [(ids, p) for ids, p, _ in batch]))
            except Exception as e:  # noqa: BLE001 - handed to every waiting agent
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, _, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)


class EngineHandle:
    """One sample's llm_engine: `await llm_engine.generate(prompt_token_ids, sampling_params)`."""

    def __init__(self, client: EngineClient, tokenizer, prompt_token_ids: list[int], seed: int, sample: int):
        self.client, self.tokenizer, self.prompt_token_ids = client, tokenizer, list(prompt_token_ids)
        self.seed, self.sample, self.turns, self.weight_versions = seed, sample, 0, []
        self.finish_reason: Optional[str] = None
        self.routed_ids: list[int] = []  # --router_replay R3: the tokens `routed` covers the positions of
        self.routed = None  # (N, L, K) the engine's routed experts of routed_ids' first N tokens

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> RequestOutput:
        if multi_modal_data:
            raise AgentError("multi_modal_data: orlhf trains text models only (multimodal is a non-goal)")
        params = copy.deepcopy(sampling_params)
        if getattr(params, "n", 1) != 1:
            raise AgentStepError(
                f"sampling_params.n = {params.n}: an agent turn generates one response (each "
                "sample already has its own agent; use --n_samples_per_prompt)"
            )
        if params.seed is None:
            params.seed = turn_seed(self.seed, self.sample, self.turns)
        self.turns += 1
        turn: TurnResult = await self.client.generate(list(prompt_token_ids), params)
        ids, lps, finish = turn.token_ids, turn.logprobs, turn.finish_reason
        if turn.routed_experts is not None:  # a turn re-reads the episode so far: keep the rows it was sampled under
            self.routed_ids, self.routed = grow_routing(
                self.routed_ids, self.routed, [*prompt_token_ids, *ids], turn.routed_experts
            )
        self.weight_versions.append(turn.weight_version)
        self.finish_reason = finish
        text = self.tokenizer.decode(ids, skip_special_tokens=getattr(params, "skip_special_tokens", True))
        logprobs = [{t: Logprob(lp)} for t, lp in zip(ids, lps)]
        return RequestOutput(list(prompt_token_ids), [CompletionOutput(ids, text, logprobs, finish)])


def turn_seed(seed: int, sample: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{sample}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
