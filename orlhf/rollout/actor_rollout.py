"""--rollout_backend trainer (--vllm_num_engines 0): the actor's ranks generate. A RolloutBackend
(rollout/backend.py), answering the calls the controller, the executors and the evaluator make of the vLLM engines.

    generate(prompts, sampling)      prompts split contiguously over the actor's ranks (PolicyWorker.generate,
                                     workers/generation.py); rollouts back in prompt order, tagged with the version
    generate_turns(0, requests)      agents' turns (PolicyWorker.generate_tokens) -> a concurrent Future
    load_weights(version)            nothing to move: the ranks that train are the ones that generate; the version
                                     tag moves, so rollouts say which update sampled them, as with engines

Invariants: a call reaches every actor rank (ZeRO-3's gather is collective), and one call runs at a time (the
controller's phases are sequential; agents' turns come through one EngineClient). Samples do not depend on the
actor's rank count (each request has its own seeded stream), so runs with different splits sample alike.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from orlhf.rollout.backend import RolloutBackend
from orlhf.types import Rollout, SamplingSpec, TurnParams, TurnResult
from orlhf.workers import PolicyWorker

log = logging.getLogger("orlhf")


class ActorRollout(RolloutBackend):
    kind = "trainer"
    turn_params = TurnParams  # agents' sampling parameters: vLLM's fields, without vLLM (rollout/executor.py)

    def __init__(self, actor, pad_id: int, eos_id: Optional[int]):
        self.actor, self.pad_id, self.eos_id = actor, pad_id, eos_id
        self.weight_version = 0
        self._turns = ThreadPoolExecutor(1, thread_name_prefix="orlhf-actor-turns")

    @classmethod
    def from_models(cls, cfg, actor, tokenizer) -> ActorRollout:
        """The actor's group generates; it needs the `tokenizer`'s pad and EOS ids."""
        if tokenizer is None:
            raise ValueError("--rollout_backend trainer: the rollout needs the run's tokenizer (pad and EOS ids)")
        log.info(
            "rollouts: generated in the actor's ranks with transformers' generate (--rollout_backend trainer): no "
            "vLLM engine, no weight sync; the sync guard compares the sampler's log-probs with the training forward's"
        )
        return cls(actor, tokenizer.pad_token_id, tokenizer.eos_token_id)

    @property
    def generating_groups(self) -> tuple:
        return (self.actor,)  # its states stay on the device, and the generate phase's cores are its ranks'

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, images: Optional[list[tuple]] = None
    ) -> list[Rollout]:
        """All rollouts, ordered by prompt then sample (image prompts are refused by the config's validation)."""
        call = self.actor.call_sharded(
            PolicyWorker.generate, list(enumerate(prompts)), sampling, self.pad_id, self.eos_id
        )
        rollouts = [r for part in call.get() for r in part][: len(prompts) * sampling.n]  # shard pads the last rank
        for r in rollouts:
            r.weight_version = self.weight_version
        return rollouts

    def generate_turns(self, index: int, requests: list) -> Future:
        """One batch of agents' turns: (ids, SamplingParams) -> TurnResult, tagged with the weight version."""

        def run() -> list[TurnResult]:
            call = self.actor.call_sharded(PolicyWorker.generate_tokens, list(requests), self.pad_id, self.eos_id)
            out = [t for part in call.get() for t in part][: len(requests)]  # (new ids, log-probs, finish reason)
            return [TurnResult(*t, weight_version=self.weight_version) for t in out]

        return self._turns.submit(run)

    def load_weights(self, version: int) -> float:
        self.weight_version = version
        return 0.0

    def shutdown(self) -> None:
        self._turns.shutdown(wait=False)
