"""DAPO dynamic sampling (--dynamic_filtering): fill a step's batch with prompts whose samples disagree.

    pool = spare prompts from earlier steps, topped up with loader batches only when too few are spare
    round 0: generate the first rollout_batch_size prompts of the pool, n samples each; score them
    keep a prompt iff low < mean of its n scores < high (algo/rewards.keep_groups, open range)
    round k: generate as many new prompts as are still missing (from the pool, then more loader batches)
    stop when rollout_batch_size prompts are kept; surplus kept groups are dropped, unused prompts stay spare

Prompts whose samples all score alike (all right or all wrong) give all-zero group advantages: they cost a
train step and teach nothing. The scores computed here are the step's scores (the controller does not score
again). Where orlhf differs from OpenRLHF v0.10.1 (samples_generator.py), on purpose:
- the pass rate is kept / generated prompts in %; OpenRLHF divides its kept samples (n per prompt) by the prompts,
  which exceeds 100 for n > 1 and is no rate;
- prompts generated past a full batch, and loader prompts read but not yet generated, stay spare for the next step;
  OpenRLHF replaces each filtered prompt with the next one as it goes and drops what a full batch did not need.
Logged per step: dynamic_filtering_pass_rate (kept / generated prompts, in %) and
dynamic_filtering_generated_per_kept (generated samples per kept sample, >= 1), and reward_generated_mean, the
mean score of every sample generated (reward_mean is over the kept ones, which filtering biases: it is the
policy's own reward that reward_generated_mean tracks).

When the loader runs out before a batch is full, fill() returns None and the run ends (as OpenRLHF drops a
partial batch): a partial batch would break the whole-optimizer-step batch sizes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from orlhf.algo.rewards import keep_groups
from orlhf.inputs.rewards import RewardResult
from orlhf.types import Rollout

log = logging.getLogger(__name__)

# Refill rounds get seeds far from any step's own (the controller seeds a step's round 0 with its step index).
ROUND_SEED_STRIDE = 1_000_000_007


@dataclass
class FilledBatch:
    prompts: list  # (rollout_batch_size,) the kept prompts, in the order their rollouts are
    rollouts: list[Rollout]  # (rollout_batch_size * n,) prompt-major; prompt_index points into `prompts`
    reward: "RewardResult"  # (rollout_batch_size * n,) rows: their rewards, scores and extra logs, computed
    info: dict  # the per-step figures named in the module docstring


class DynamicFilter:
    """Holds the spare prompts between steps; fill() builds one step's batch (module docstring)."""

    def __init__(
        self,
        batch_prompts: int,
        n_samples: int,
        reward_range: tuple[float, float],
        generate: Callable[[list, int], list[Rollout]],
        score: Callable[[list[Rollout], list], "RewardResult"],
        max_rounds: int = 64,
    ):
        self.batch_prompts, self.n = batch_prompts, n_samples
        self.low, self.high = float(reward_range[0]), float(reward_range[1])
        self.generate, self.score = generate, score
        self.max_rounds = max_rounds
        self.spare: list = []

    def fill(self, more: Iterator[list], step_index: int) -> Optional[FilledBatch]:
        """Kept prompts, their rollouts and scores for one step; None when the data ran out first.
        `more` yields the loader's prompt batches; only as many are read as the step needs."""
        kept_prompts: list = []
        kept_rollouts: list[Rollout] = []
        kept: list[RewardResult] = []
        generated, score_sum = 0, 0.0
        for round_ in range(self.max_rounds):
            need = self.batch_prompts - len(kept_prompts)
            if not self._top_up(need, more):
                return None
            batch, self.spare = self.spare[:need], self.spare[need:]
            rollouts = self.generate(batch, step_index + ROUND_SEED_STRIDE * round_)
            result = self.score(rollouts, batch)
            scores = result.scores.float()  # OpenRLHF filters on `scores` (the rewards unless the source differs)
            generated += len(batch)
            score_sum += float(scores.sum())
            for g in keep_groups(scores, self.n, self.low, self.high).nonzero().flatten().tolist():
                if len(kept_prompts) == self.batch_prompts:
                    break
                rows = range(g * self.n, (g + 1) * self.n)
                new_index = len(kept_prompts)
                kept_prompts.append(batch[g])
                kept_rollouts += [dataclasses.replace(rollouts[i], prompt_index=new_index) for i in rows]
                kept.append(result.rows(g * self.n, (g + 1) * self.n))
            if len(kept_prompts) == self.batch_prompts:
                break  # full, possibly on the last allowed round
        else:
            raise RuntimeError(
                f"--dynamic_filtering kept {len(kept_prompts)} of {self.batch_prompts} prompts after "
                f"{self.max_rounds} rounds ({generated} prompts generated): almost every prompt's "
                "samples score alike; widen --dynamic_filtering_reward_range or check the reward."
            )
        info = {
            "dynamic_filtering_pass_rate": 100.0 * len(kept_prompts) / generated,
            "dynamic_filtering_generated_per_kept": generated / len(kept_prompts),
            "reward_generated_mean": score_sum / (generated * self.n),
        }
        return FilledBatch(kept_prompts, kept_rollouts, RewardResult.cat(kept), info)

    def _top_up(self, need: int, more: Iterator[list]) -> bool:
        """Make sure `need` spare prompts exist, pulling loader batches; False if the loader is exhausted."""
        while len(self.spare) < need:
            try:
                self.spare.extend(next(more))
            except StopIteration:
                log.info("dynamic filtering: the prompt data ran out before the batch was full; stopping")
                return False
        return True
