"""A rollout backend for the controller's pure-logic tests (call order, saves, stops): a RolloutBackend
(orlhf/rollout/backend.py) whose generate is a function of the test's (by default three tokens per sample) and whose
weight loads are recorded. Only what the contract requires is written here; everything else is the base's default."""

from __future__ import annotations

from typing import Callable, Optional

from orlhf.rollout.backend import RolloutBackend
from orlhf.types import Rollout


def three_tokens(prompts, sampling) -> list[Rollout]:
    return [
        Rollout(prompt_index=i, prompt_ids=ids, response_ids=[5, 6, 7], logprobs=[-1.0] * 3, finished=True)
        for i, ids in enumerate(prompts)
        for _ in range(sampling.n)
    ]


class StandInRollout(RolloutBackend):
    kind = "stand-in"

    def __init__(self, generate: Optional[Callable] = None, log: Optional[list] = None):
        self._generate, self.log = generate or three_tokens, log
        self.version = 0  # the weight version last loaded: rollouts say it, as the contract asks

    @classmethod
    def from_models(cls, cfg, actor, tokenizer) -> StandInRollout:
        return cls(log=getattr(actor, "log", None))  # a run's start-up builds it beside the test's actor

    def generate(self, prompts, sampling, images=None):
        out = self._generate(prompts, sampling)
        for r in out:
            r.weight_version = r.weight_version or self.version  # a test's own tag stays
        return out

    def load_weights(self, version: int) -> float:
        if self.log is not None:
            self.log.append("sync")
        self.version = version
        return 0.0
