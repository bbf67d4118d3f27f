"""Rollouts + model outputs -> Experience.

    [Rollout] --rollouts_to_batch--> SequenceBatch (+ engine log-probs, rewards' text inputs)
    SequenceBatch --ref/critic/reward/actor groups--> log-probs, values, scores
    --> KL-shaped rewards, advantages, returns (algo/) --> Experience
"""

from __future__ import annotations

import torch

from orlhf.types import Rollout, SequenceBatch


def rollouts_to_batch(rollouts: list[Rollout], pad_id: int) -> tuple[SequenceBatch, torch.Tensor]:
    """Pad rollouts into one batch: prompts left-padded to the longest prompt, responses right-padded to the
    longest response. Returns the batch and the engine's log-probs (B, A), 0 on padding.

    An empty response keeps one padded action slot with action_mask 0, so A >= 1 always.
    """
    if not rollouts:
        raise ValueError("no rollouts to batch")
    P = max(len(r.prompt_ids) for r in rollouts)
    A = max(1, max(len(r.response_ids) for r in rollouts))
    B = len(rollouts)
    seq = torch.full((B, P + A), pad_id, dtype=torch.long)
    attn = torch.zeros(B, P + A, dtype=torch.long)
    action_mask = torch.zeros(B, A, dtype=torch.bool)
    logprobs = torch.zeros(B, A, dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        seq[i, P - p:P] = torch.tensor(r.prompt_ids, dtype=torch.long)
        attn[i, P - p:P] = 1
        if n:
            seq[i, P:P + n] = torch.tensor(r.response_ids, dtype=torch.long)
            attn[i, P:P + n] = 1
            action_mask[i, :n] = True
            logprobs[i, :n] = torch.tensor(r.logprobs[:n], dtype=torch.float32)
    return SequenceBatch(seq, attn, action_mask), logprobs
