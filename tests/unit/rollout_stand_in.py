"""A rollout backend for the controller's pure-logic tests (call order, saves, stops): a RolloutBackend
(orlhf/rollout/backend.py) whose generate is a function of the test's and whose weight loads are recorded."""

from __future__ import annotations

from typing import Callable, Optional

from orlhf.rollout.backend import RolloutBackend


class StandInRollout(RolloutBackend):
    kind = "stand-in"

    def __init__(self, generate: Optional[Callable] = None, log: Optional[list] = None):
        self._generate, self.log = generate, log

    @classmethod
    def start_plan(cls, cfg) -> tuple[str, ...]:
        return ("start_models",)

    @classmethod
    def connect(cls, cfg, launched, actor, tokenizer, stack, mark):
        raise NotImplementedError("built by the test")

    def __len__(self) -> int:
        return 1

    def generate(self, prompts, sampling, images=None):
        return self._generate(prompts, sampling)

    def generate_turns(self, index, requests):
        raise NotImplementedError("single-turn tests")

    def load_weights(self, version: int) -> float:
        if self.log is not None:
            self.log.append("sync")
        return 0.0

    def shutdown(self) -> None:
        pass
