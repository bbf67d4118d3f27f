"""The critic: V(s_t) for every action position, trained with the clipped value loss.

    ValueModel = HF backbone (AutoModel: hidden states, no LM head) + value_head Linear(hidden, 1, bias=False)
    sequences (B, T) --backbone--> (B, T, H) --value_head--> (B, T) [--(v - mean) / std--] --[:, -A-1:-1]--> (B, A)

The value of action t is read at the position *before* it (the state that chose the token), as OpenRLHF does.
Initialisation (load_value_model): the head "<--value_head_prefix>.weight" of the folder when it has one (an
OpenRLHF reward model or critic, or HF's XForSequenceClassification with num_labels=1: the critic starts out
predicting the reward model's score); a fresh head (N(0, initializer_range), seeded, identical on every rank)
from a plain causal-LM folder; a HeadError when the folder is a reward/critic model whose head is not there
(inputs/head_files.py). With --normalize_reward and mean/std in the folder's config.json, values are
(v - mean) / std in training too, as OpenRLHF's critic computes them.
Parameter names are OpenRLHF's critic layout with the old head name: "<base_model_prefix>.*" (e.g.
"model.layers.0...") + "value_head.weight", whatever --value_head_prefix is (checkpoints of earlier runs stay
loadable).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Optional

import torch
from torch import nn

from orlhf.algo.losses import LossNorm, aggregate, masked_mean, value_loss_per_token
from orlhf.config.worker_config import CriticConfig, RewardConfig
from orlhf.distributed.endpoints import endpoint
from orlhf.inputs.head_files import resolve_prefix, stored_reward_stats
from orlhf.types import Experience, SequenceBatch, TrainStats
from orlhf.workers.base import DeepSpeedWorker, position_ids_from
from orlhf.workers.batching import Packed, pack
from orlhf.workers.loading import from_pretrained
from orlhf.workers.shared_prompt import shared_prompt_forward, worker_shares_prompts
from orlhf.workers.value_head import find_head

log = logging.getLogger("orlhf.workers")


class ValueModel(nn.Module):
    """A backbone and a scalar head on every position: (B, T) -> (B, T) values. Also the reward model's shape."""

    def __init__(self, backbone: nn.Module, head: nn.Module, normalize: Optional[tuple[float, float]] = None):
        super().__init__()
        self.prefix = getattr(backbone, "base_model_prefix", "") or "model"
        self.add_module(self.prefix, backbone)
        self.value_head = head
        self.config = backbone.config
        # (mean, std) applied to every output, or None. Plain floats, not buffers: the state dict (and so every
        # checkpoint and weight sync) stays the same with and without --normalize_reward.
        self.normalize = normalize

    @property
    def backbone(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
        past_key_values=None,
        use_cache: bool = False,
    ):
        """(B, T) values; with use_cache, (values, the backbone's cache) (workers/shared_prompt.py).
        position_ids default to counting attention_mask's real tokens; a packed row (orlhf/workers/batching.py) passes
        its
        own and attention_mask=None."""
        if position_ids is None:
            position_ids = position_ids_from(attention_mask)
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        values = self.value_head(out.last_hidden_state).squeeze(-1).float()  # (B, T)
        if self.normalize is not None:
            mean, std = self.normalize
            values = (values - mean) / std
        return (values, getattr(out, "past_key_values", None)) if use_cache else values

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)


def packed_values(model: nn.Module, batch) -> tuple[torch.Tensor, Packed]:
    """A ValueModel over the batch packed into one row (orlhf/workers/batching.py): (N,) values and the Packed
    layout."""
    p = pack(batch)
    return model(input_ids=p.input_ids, attention_mask=None, position_ids=p.position_ids)[0], p


def shared_values(model: nn.Module, batch, through_last: bool = False) -> Optional[torch.Tensor]:
    """A ValueModel's values of columns P-1 .. T-2 (through T-1 with through_last) with each distinct prompt run
    once (workers/shared_prompt.py), or None where that does not apply: then the caller runs the whole rows."""

    def run(ids, mask, pos, cache, outputs: bool):
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)

    return shared_prompt_forward(run, batch, position_ids_from(batch.attention_mask), through_last)


def load_value_model(cfg: CriticConfig | RewardConfig, required: bool = False) -> ValueModel:
    """The folder's backbone and its value head "<prefix>.weight" (inputs/head_files.py), with OpenRLHF's
    (v - mean) / std when --normalize_reward is given and config.json stores mean/std.

    required=False (the critic): a folder with no head at all (a plain causal LM) gets a fresh seeded head.
    required=True (the reward model): a missing head is a HeadError, never a random head.
    """
    from transformers import AutoModel

    prefix = resolve_prefix(cfg.model_path, cfg.head.value_head_prefix)
    stats = stored_reward_stats(cfg.model_path)
    backbone = from_pretrained(AutoModel, cfg.model_path, cfg)
    hidden = backbone.config.hidden_size
    backbone_prefix = getattr(backbone, "base_model_prefix", "") or "model"
    head = find_head(cfg.model_path, prefix, hidden, backbone_prefix, required)
    if head is None:
        head = nn.Linear(hidden, 1, bias=False)
        gen = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            std = getattr(backbone.config, "initializer_range", 0.02)
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
        log.info("%s: %s has no value head; starting from a fresh one", cfg.role, cfg.model_path)
    else:
        log.info("%s: value head %s.weight from %s", cfg.role, prefix, cfg.model_path)
    normalize = stats if cfg.head.normalize_reward else None
    if stats is not None and not cfg.head.normalize_reward:
        log.info(
            "%s: %s stores reward mean %g / std %g; pass --normalize_reward to apply them (as OpenRLHF)",
            cfg.role,
            cfg.model_path,
            *stats,
        )
    elif normalize is not None:
        log.info(
            "%s: --normalize_reward: (x - %g) / %g with the mean/std stored in %s/config.json",
            cfg.role,
            *normalize,
            cfg.model_path,
        )
    return ValueModel(backbone, head.to(backbone.dtype), normalize)


class CriticWorker(DeepSpeedWorker):
    """V(s) per action position, and value-loss train steps."""

    def build_model(self) -> nn.Module:
        model = load_value_model(self.cfg, required=False)
        if self.cfg.lora is not None:  # an adapter on the backbone; the value head stays whole and trains
            from orlhf.workers.lora import apply_lora

            model.add_module(model.prefix, apply_lora(model.backbone, self.cfg.lora, causal_lm=False))
        return model

    @endpoint
    def init(self) -> None:
        """Collective: all ranks call it together."""
        super().init()
        self.shared_prompt = worker_shares_prompts(
            self, lambda b: self._action_values(b, False), lambda b: shared_values(self.engine, b)
        )

    @endpoint
    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: V at the position before each action; 0 where action_mask is 0."""
        self.engine.eval()

        def fn(mb: SequenceBatch) -> torch.Tensor:
            return self._action_values(mb, self.shared_prompt)

        return self.forward_micro_batches(batch, fn)

    def _action_values(self, mb: SequenceBatch | Experience, shared: bool) -> torch.Tensor:
        if self.cfg.packing_samples:
            v, p = packed_values(self.engine, mb)
            return p.unflatten(v[p.score_index])
        v = shared_values(self.engine, mb) if shared else None  # (b, A): the columns before each action
        if v is None:
            v = self.engine(input_ids=mb.sequences, attention_mask=mb.attention_mask)[:, -mb.num_actions - 1 : -1]
        return v * mb.action_mask

    @endpoint
    def train_step(self, batch: Experience) -> TrainStats:
        """Clipped value regression onto `returns`; len(batch) must be a multiple of train_batch_size / world."""
        if batch.returns is None:
            raise ValueError("critic train_step needs Experience.returns (gae advantages)")
        return self.train_micro_batches(batch, self._loss)

    @endpoint
    def save_value_network(self, out_dir: str) -> None:
        """--save_value_network: the critic as a folder (model.safetensors in OpenRLHF's critic names, backbone
        config.json; with LoRA the adapter merged in). Collective under ZeRO-3: every rank calls it; rank 0 writes."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        state = self.state_dict_full()
        if self.rank == 0 and self.cfg.lora is not None:  # a plain critic folder: the adapter merged in
            from orlhf.workers.lora import merged_state

            state = merged_state(self.module, state)
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
            config = copy.deepcopy(self.module.backbone.config)
            config.value_head_prefix = "value_head"  # so orlhf and OpenRLHF find the head by name
            config.save_pretrained(out_dir)
        if self.world_size > 1:
            dist.barrier()

    def _loss(self, mb: Experience, norm: LossNorm) -> tuple[torch.Tensor, dict]:
        """Clipped value loss, aggregated over the optimizer step like the actor's (algo/losses.py)."""
        values = self._action_values(mb, self.shared_prompt_train)
        per_token, bound = value_loss_per_token(values, mb.values, mb.returns, self.cfg.loss.value_clip)
        loss = aggregate(per_token, mb.action_mask, self.cfg.loss.loss_agg_mode, norm)
        return loss, {
            # this micro-batch's own aggregate in the optimized mode (`loss` is scaled for DeepSpeed: no figure)
            "loss": aggregate(per_token.detach(), mb.action_mask, self.cfg.loss.loss_agg_mode).item(),
            "clip_frac": masked_mean(bound.float(), mb.action_mask).item(),
            "values": masked_mean(values.detach(), mb.action_mask).item(),
        }
