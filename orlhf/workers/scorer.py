"""The reward model worker (frozen): one scalar per sequence, read on its last real token.

    sequences (B, T) --backbone--> (B, T, H) --score head--> (B, T) --at last real token--> (B,)

The last real token comes from attention_mask (responses are right-padded), not from pad_token_id as in HF's
XForSequenceClassification.forward, which picks the wrong token when pad == eos. The reference model lives in
causal_lm.py (ReferenceWorker): it is a causal LM like the actor.
"""

from __future__ import annotations

import torch
from torch import nn

from orlhf.distributed.endpoints import endpoint
from orlhf.types import SequenceBatch
from orlhf.workers.base import DeepSpeedWorker
from orlhf.workers.critic import load_value_model, packed_values, shared_values
from orlhf.workers.shared_prompt import worker_shares_prompts


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last 1 in each row of a (B, T) mask."""
    t = attention_mask.shape[1]
    return t - 1 - attention_mask.long().flip(-1).argmax(-1)


class RewardWorker(DeepSpeedWorker):
    """A reward model folder under ZeRO inference: OpenRLHF's layout (backbone + "<--value_head_prefix>.weight",
    optional mean/std in config.json applied with --normalize_reward) or HF's XForSequenceClassification
    (num_labels=1, head "score"). A folder without that head is a HeadError (inputs/head_files.py)."""

    def build_model(self) -> nn.Module:
        return load_value_model(self.cfg, required=True)

    @endpoint
    def init(self) -> None:
        """Collective: all ranks call it together."""
        super().init()

        def per_action(scores: torch.Tensor | None, batch: SequenceBatch) -> torch.Tensor | None:
            """(B,) -> (B, A): same_as_plain compares outputs where the check batch has real actions."""
            return None if scores is None else scores[:, None].expand(batch.action_mask.shape)

        self.shared_prompt = worker_shares_prompts(
            self, lambda b: per_action(self._scores(b, False), b), lambda b: per_action(self._shared_scores(b), b)
        )

    @endpoint
    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """(B,) float32 on CPU: the reward model's score of each whole sequence."""
        return self.forward_micro_batches(batch, lambda mb: self._scores(mb, self.shared_prompt))

    def _scores(self, mb: SequenceBatch, shared: bool) -> torch.Tensor:
        if self.cfg.packing_samples:
            v, p = packed_values(self.engine, mb)
            return v[p.last_index]
        scores = self._shared_scores(mb) if shared else None
        if scores is not None:
            return scores
        v = self.engine(input_ids=mb.sequences, attention_mask=mb.attention_mask)  # (b, T)
        return v.gather(1, last_token_index(mb.attention_mask).unsqueeze(1)).squeeze(1)

    def _shared_scores(self, mb: SequenceBatch) -> torch.Tensor | None:
        """(b,) scores with each distinct prompt run once (workers/shared_prompt.py), or None where that does not
        apply. The values come for columns P-1 .. T-1, and a row's last real token is at P-1 or later."""
        v = shared_values(self.engine, mb, through_last=True)  # (b, A + 1)
        if v is None:
            return None
        start = mb.sequences.shape[1] - mb.num_actions - 1
        return v.gather(1, (last_token_index(mb.attention_mask) - start).unsqueeze(1)).squeeze(1)
