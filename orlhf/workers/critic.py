"""The critic: V(s_t) for every action position, trained with the clipped value loss.

    ValueModel = HF backbone (AutoModel: hidden states, no LM head) + value_head Linear(hidden, 1, bias=False)
    sequences (B, T) --backbone--> (B, T, H) --value_head--> (B, T) --[:, -A-1:-1]--> (B, A)

The value of action t is read at the position *before* it (the state that chose the token), as OpenRLHF does.
Initialisation: from a causal-LM folder the value head is fresh (N(0, initializer_range), seeded, identical
on every rank); from a reward-model folder (XForSequenceClassification, num_labels=1) it is that model's
`score` head, so the critic starts out predicting the reward model's score.
Parameter names are OpenRLHF's critic layout: "<base_model_prefix>.*" (e.g. "model.layers.0...") + "value_head.weight".
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from orlhf.algo.losses import masked_mean, value_loss
from orlhf.batching import Packed, pack
from orlhf.config import WorkerConfig
from orlhf.types import Experience, SequenceBatch, TrainStats
from orlhf.workers.base import DeepSpeedWorker, position_ids_from
from orlhf.workers.loading import from_pretrained


class ValueModel(nn.Module):
    """A backbone and a scalar head on every position: (B, T) -> (B, T) values. Also the reward model's shape."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.prefix = getattr(backbone, "base_model_prefix", "") or "model"
        self.add_module(self.prefix, backbone)
        self.value_head = head
        self.config = backbone.config

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """position_ids default to counting attention_mask's real tokens; a packed row (orlhf/batching.py)
        passes its own and attention_mask=None."""
        if position_ids is None:
            position_ids = position_ids_from(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)


def packed_values(model: nn.Module, batch) -> tuple[torch.Tensor, Packed]:
    """A ValueModel over the batch packed into one row (orlhf/batching.py): (N,) values and the Packed layout."""
    p = pack(batch)
    return model(input_ids=p.input_ids, attention_mask=None, position_ids=p.position_ids)[0], p


def is_reward_model_folder(path: str) -> bool:
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(path).architectures or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def load_sequence_classifier(cfg: WorkerConfig) -> ValueModel:
    """A reward-model folder as a ValueModel: its backbone and its `score` head (num_labels=1)."""
    from transformers import AutoModelForSequenceClassification

    model = from_pretrained(AutoModelForSequenceClassification, cfg.model_path, cfg, num_labels=1)
    head = getattr(model, "score", None)
    if head is None:
        raise ValueError(f"{cfg.model_path}: expected a sequence-classification model with a `score` head "
                         f"(Llama/Qwen/Mistral layout), got {type(model).__name__}")
    return ValueModel(model.base_model, head)


def load_value_model(cfg: WorkerConfig) -> ValueModel:
    """Critic init: the reward model's head if `model_path` is a reward model, else a fresh seeded head."""
    if is_reward_model_folder(cfg.model_path):
        return load_sequence_classifier(cfg)
    from transformers import AutoModel

    backbone = from_pretrained(AutoModel, cfg.model_path, cfg)
    head = nn.Linear(backbone.config.hidden_size, 1, bias=False, dtype=backbone.dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        std = getattr(backbone.config, "initializer_range", 0.02)
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
    return ValueModel(backbone, head)


class CriticWorker(DeepSpeedWorker):
    """V(s) per action position, and value-loss train steps."""

    def build_model(self) -> nn.Module:
        return load_value_model(self.cfg)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: V at the position before each action; 0 where action_mask is 0."""
        self.engine.eval()

        def fn(mb: SequenceBatch) -> torch.Tensor:
            return self._action_values(mb)

        return self.forward_micro_batches(batch, fn)

    def _action_values(self, mb: SequenceBatch | Experience) -> torch.Tensor:
        if self.cfg.packing_samples:
            v, p = packed_values(self.engine, mb)
            return p.unflatten(v[p.score_index])
        a = mb.num_actions
        v = self.engine(input_ids=mb.sequences, attention_mask=mb.attention_mask)  # (b, T)
        return v[:, -a - 1:-1] * mb.action_mask

    def train_step(self, batch: Experience) -> TrainStats:
        """Clipped value regression onto `returns`; len(batch) must be a multiple of train_batch_size / world."""
        if batch.returns is None:
            raise ValueError("critic train_step needs Experience.returns (gae advantages)")
        return self.train_micro_batches(batch, self._loss)

    def save_value_network(self, out_dir: str) -> None:
        """--save_value_network: the critic as a folder (model.safetensors in OpenRLHF's critic names, backbone
        config.json). Collective under ZeRO-3: every rank calls it; rank 0 writes."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        state = self.state_dict_full()
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
            self.module.backbone.config.save_pretrained(out_dir)
        if self.world_size > 1:
            dist.barrier()

    def _loss(self, mb: Experience) -> tuple[torch.Tensor, dict]:
        values = self._action_values(mb)
        loss, clip_frac = value_loss(values, mb.values, mb.returns, mb.action_mask, self.cfg.value_clip)
        return loss, {"loss": loss.item(), "clip_frac": clip_frac.item(),
                      "values": masked_mean(values.detach(), mb.action_mask).item()}
