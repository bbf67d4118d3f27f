"""Evaluation during training (--eval_dataset) and the best checkpoint (--best_metric_key).

    every --eval_steps steps and after the last one (controller, after the step's weight sync), and before the
    first step with --eval_before_train (logged as step 0):
      held-out prompts --executor (same engines, current weights; --eval_temperature,
                                   --eval_n_samples_per_prompt samples each)--> rollouts
      --score (the agent's rewards, the reward function / HTTP server, or the reward-model group)--> scores
      --> eval/reward_mean, eval/pass@1, eval/pass@k (k = samples per prompt), eval/response_length
      best_metric_key improved? -> a checkpoint in <ckpt_path>/best/ (its own rotation of one: --max_ckpt_num
                                   never deletes it)

Invariant: evaluation never changes the training trajectory. It samples with its own seeds (per-request seeds,
so the engines' training samples do not depend on it), touches no trainer state (no train step, no reward
normalization or KL controller update, no loader position, no global RNG), and runs between a weight sync and
the next generation, so it sees exactly the weights the next step generates with.

pass@1 is the share of samples whose score is >= 1 (rewards are 0/1 for pass-style tasks); pass@k the share of
prompts with at least one of its k samples >= 1. reward_mean is the mean score, whatever its scale.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from orlhf.types import Rollout, SamplingSpec

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 7_919_000_003  # eval seeds live apart from the training steps' (seed * 1_000_003 + step)
METRIC_KEYS = ("reward_mean", "pass@1", "pass@k")


def eval_metrics(scores: torch.Tensor, n: int, response_lengths: Optional[list[int]] = None) -> dict[str, float]:
    """scores (prompts * n,) prompt-major -> eval/reward_mean, eval/pass@1, eval/pass@<n> (see the docstring)."""
    groups = scores.float().reshape(-1, n)  # (prompts, n)
    passed = groups >= 1.0
    out = {
        "eval/reward_mean": groups.mean().item(),
        "eval/pass@1": passed.float().mean().item(),
        f"eval/pass@{n}": passed.any(dim=1).float().mean().item(),
    }
    if response_lengths:
        out["eval/response_length"] = sum(response_lengths) / len(response_lengths)
    return out


def metric_name(key: str, n: int) -> str:
    """--best_metric_key (reward_mean | pass@1 | pass@k, with or without eval/) -> the logged metric name."""
    key = key.removeprefix("eval/")
    return f"eval/pass@{n}" if key == "pass@k" else f"eval/{key}"


class Evaluator:
    """Runs one evaluation with the controller's executor and scoring; tracks the best value of one metric."""

    def __init__(
        self,
        prompts: list,
        n_samples: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        every: int,
        best_metric_key: Optional[str] = None,
        before_train: bool = False,
    ):
        self.prompts, self.n, self.every = prompts, n_samples, every
        self.before_train = before_train  # --eval_before_train: once before step 1 too (a fresh run, not a resume)
        self.spec = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, n=n_samples)
        self.seed = seed
        self.best_key = metric_name(best_metric_key, n_samples) if best_metric_key else None
        self.best: Optional[float] = None  # best value of best_key so far (restored on resume)
        self.last_step = -1

    def due(self, step: int, last: bool) -> bool:
        """After step `step` (1-based count of steps done): every `every` steps, and after the last step."""
        if step == self.last_step:
            return False
        return (self.every > 0 and step % self.every == 0) or last

    def run(
        self,
        step: int,
        generate: Callable[[list, SamplingSpec], list[Rollout]],
        score: Callable[[list[Rollout], list], torch.Tensor],
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        # The same seed at every evaluation: differences between evaluations come from the weights only.
        rollouts = generate(self.prompts, SamplingSpec(**self.spec, seed=self.seed * 1_000_003 + EVAL_SEED_OFFSET))
        scores = score(rollouts, self.prompts)
        lengths = [sum(r.action_mask) if r.action_mask is not None else len(r.response_ids) for r in rollouts]
        metrics = eval_metrics(scores, self.n, lengths)
        metrics["timing/eval"] = time.perf_counter() - t0
        self.last_step = step
        log.info(
            "eval at step %d: %s", step, ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))
        )
        return metrics

    def improved(self, metrics: dict[str, float]) -> bool:
        """True (and remembered) when best_key's value beats every earlier evaluation."""
        if self.best_key is None:
            return False
        value = metrics[self.best_key]
        if self.best is not None and value <= self.best:
            return False
        self.best = value
        return True
