"""The score phase of a PPO step: everything that reads a batch's rollouts before the update, started together on
the groups and gathered after (the controller's loop calls it; no Ray here either).

    Scorer.ahead(prompts, rollouts)       async mode, as soon as a batch is generated: its tensors, and the frozen
                                          models' calls started (reference log-probs, reward-model scores)
    Scorer.score(batch, rollouts, ...)    reward | actor old log-probs | ref log-probs | critic values; the
                                          reward function / HTTP server scores while the groups compute
    Scorer.rewards(rollouts, prompts)     the agents' own episode rewards, else the reward function / server
    Scorer.eval_scores(rollouts, prompts) held-out scores for evaluation: no training state touched

With LoRA the reference is the actor's base weights (adapter off), scored in the actor's ranks in the same call as
the old log-probs (TrainConfig.reference_from_actor); in async mode it waits for score() like them.
Skipped, as they cannot change the update: the reference without a KL (its group is not even started:
TrainConfig.has_reference), the actor's old log-probs on a single pass (TrainConfig.single_pass: the training
forward supplies them and the ratio is 1 there). --normalize_reward's running statistics live here (updated with
every batch's rewards, applied in make_experience); a reward model's stored mean/std are applied in its worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from orlhf.algo.rewards import RunningMoments
from orlhf.inputs.head_files import reward_normalization
from orlhf.rollout.executor import agent_reward_result, agent_scores
from orlhf.trainer.experience import rollouts_to_batch
from orlhf.types import Rollout, SequenceBatch
from orlhf.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker

if TYPE_CHECKING:
    from orlhf.config.train_config import TrainConfig
    from orlhf.inputs.rewards import RewardResult

log = logging.getLogger(__name__)


@dataclass
class ScoredAhead:
    """A generated batch as Scorer.ahead left it: its tensors and the frozen models' calls in flight."""

    batch: SequenceBatch
    engine_log_probs: torch.Tensor
    ref_call: Any  # distributed/groups.GroupCall of ReferenceWorker.log_probs, or None
    reward_call: Any  # distributed/groups.GroupCall of RewardWorker.scores, or None


class Scorer:
    """`models`: controller.Models; `reward_source`: a rewards.RewardSource (function file / HTTP), None when a
    reward-model group scores."""

    def __init__(self, cfg: TrainConfig, models, tokenizer, reward_source=None):
        self.m, self.tok, self.reward_source = models, tokenizer, reward_source
        self.single_pass = cfg.single_pass
        self.ref_from_actor = cfg.reference_from_actor  # LoRA: the actor's ranks score the base weights
        self.records_routing = cfg.ppo.router_replay == "R2"  # the old-log-prob forward records the actor's routing
        # --normalize_reward: a reward model's stored mean/std (applied in its worker, as OpenRLHF), else running
        # statistics here; never both (head_files.reward_normalization).
        norm = reward_normalization(cfg.ppo.normalize_reward, cfg.data.reward_pretrain)
        self.reward_norm = RunningMoments() if norm == "running" else None
        if norm != "off":
            log.info(
                "--normalize_reward: %s",
                "the reward model's stored mean/std"
                if norm == "stored"
                else "running mean/std of this run's rewards (the reward source stores none)",
            )

    def ahead(self, prompts: list, rollouts: list[Rollout]) -> ScoredAhead:
        """Async mode, in the producer thread as soon as a batch is generated: the batch tensors, and the forwards
        of the frozen models started (reference log-probs, reward-model scores), which depend on nothing the
        trainers change. They run while the trainers still work on the batch before, and score() takes their
        results instead of calling again: the same calls on the same tensors, earlier. The critic's values and
        the actor's old log-probs wait for score(): they read weights that train. (On CPU a reference hosted in a
        one-rank actor's process runs these beside the actor's call in flight: cpu/hosting.py.)"""
        batch, engine_log_probs = rollouts_to_batch(rollouts, self.tok.pad_token_id)
        frozen = unrouted(batch)
        ref_call = self.m.ref.call_sharded(ReferenceWorker.log_probs, frozen) if self.m.ref else None
        reward_call = self.m.reward.call_sharded(RewardWorker.scores, frozen) if self.m.reward else None
        return ScoredAhead(batch, engine_log_probs, ref_call, reward_call)

    def score(
        self,
        batch: SequenceBatch,
        rollouts: list[Rollout],
        prompts: list,
        reward=None,
        ahead: Optional[ScoredAhead] = None,
    ):
        """Everything that reads the rollouts, started together and gathered after. Returns (reward, old
        log-probs or None, ref log-probs or None, values or None); the reward part is a rewards.RewardResult:
        .rewards to train on, .scores for filtering, .extra_logs to log (`reward`: known already, from
        --dynamic_filtering). `ahead`: the reference and reward-model calls already started (ahead())."""
        from orlhf.inputs.rewards import RewardResult

        m = self.m
        if self.ref_from_actor:  # one call: a rank must not run the two forwards at once (adapter on / off)
            fn = PolicyWorker.base_log_probs if self.single_pass else PolicyWorker.log_probs_and_base
            actor_call = m.actor.call_sharded(fn, batch)
            old_call = None
        else:
            actor_call = None
            old_call = None if self.single_pass else m.actor.call_sharded(PolicyWorker.log_probs, batch)
        frozen = unrouted(batch)  # the other models keep their own routing (docs/moe.md)
        if ahead is not None:
            ref_call = ahead.ref_call
        else:
            ref_call = m.ref.call_sharded(ReferenceWorker.log_probs, frozen) if m.ref else None
        value_call = m.critic.call_sharded(CriticWorker.values, frozen) if m.critic else None
        if ahead is not None:
            reward_call = ahead.reward_call
        else:
            reward_call = m.reward.call_sharded(RewardWorker.scores, frozen) if m.reward and reward is None else None
        if reward is not None:
            pass
        elif self.reward_source is not None or agent_scores(rollouts) is not None:  # while the groups compute
            reward = self.rewards(rollouts, prompts)
        else:
            reward = RewardResult.of(reward_call.get_cat().float())
        if self.reward_norm is not None:
            self.reward_norm.update(reward.rewards)
        values = value_call.get_cat() if value_call else None
        old_lp = old_call.get_cat() if old_call else None  # None on a single pass (module docstring)
        ref_lp = ref_call.get_cat() if ref_call else None
        if actor_call is not None:
            got = actor_call.get_cat()
            old_lp, ref_lp = (got[:, 0], got[:, 1]) if got.dim() == 3 else (None, got)
        return reward, old_lp, ref_lp, values

    def routed(self, batch: SequenceBatch) -> SequenceBatch:
        """--router_replay R2, after score(): the batch with the experts the actor's old-log-prob forward routed its
        tokens to (each rank's share, in batch order), for the training forwards to replay; else as it is."""
        if not self.records_routing or self.single_pass:
            return batch
        parts = self.m.actor.call(PolicyWorker.recorded_routing).get()
        return replace(batch, routing=torch.cat(parts)[: len(batch)])

    def rewards(self, rollouts: list[Rollout], prompts: list) -> RewardResult:
        """rewards.RewardResult from the agents' own episode rewards and scores (--agent_func_path), else from the
        reward function / server (not the reward-model group)."""
        given = agent_reward_result(rollouts)
        if given is not None:
            return given
        return self.reward_source.evaluate(*reward_inputs(self.tok, rollouts, prompts))

    def eval_scores(self, rollouts: list[Rollout], prompts: list) -> torch.Tensor:
        """Scores from the run's reward source, touching no training state (no reward normalization update)."""
        given = agent_scores(rollouts)
        if given is not None:
            return torch.tensor(given, dtype=torch.float32)
        if self.reward_source is not None:
            return self.reward_source.score(*reward_inputs(self.tok, rollouts, prompts)).float()
        batch, _ = rollouts_to_batch(rollouts, self.tok.pad_token_id)
        return self.m.reward.call_sharded(RewardWorker.scores, batch).get_cat().float()


def unrouted(batch: SequenceBatch) -> SequenceBatch:
    """The batch without its routing (--router_replay): the reference, critic and reward model route themselves."""
    return batch if batch.routing is None else replace(batch, routing=None)


def reward_inputs(tokenizer, rollouts: list[Rollout], prompts: list) -> tuple[list[str], list[str], list]:
    """(queries, prompts, labels) as inputs/rewards.py's contract says: query = the prompt text exactly as given to the
    model + the decoded response. Decoding prompt + response together would drop the chat template's special
    tokens from the prompt part, so the query would no longer start with the prompt text."""
    texts = [prompts[r.prompt_index].text for r in rollouts]
    responses = tokenizer.batch_decode([r.response_ids for r in rollouts], skip_special_tokens=True)
    return [t + resp for t, resp in zip(texts, responses)], texts, [prompts[r.prompt_index].label for r in rollouts]
