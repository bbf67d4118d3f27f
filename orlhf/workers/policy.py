"""Causal-LM workers: the actor (PolicyWorker, trained with PPO) and the reference (ReferenceWorker, frozen).

Both score the same thing, log pi(a_t | s_<t) for the last A tokens of each sequence:

    sequences (B, T) --model(position_ids from attention_mask)--> logits of positions T-A-1 .. T-2 (B, A, V)
        / temperature --log-softmax, gather sequences[:, -A:]--> log_probs (B, A)

The actor's train_step is OpenRLHF's PPO actor step, per micro-batch:
    loss = policy_loss(log pi, log pi_old, advantages)          clipped surrogate, token-level mean
         - entropy_loss_coef * entropy                          (if > 0)
         + kl_coef * approx_kl(log pi, log pi_ref)              (if use_kl_loss)
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Optional

import torch
from torch import nn

from orlhf.algo.kl import approx_kl
from orlhf.algo.losses import entropy_from_logits, masked_mean, policy_loss
from orlhf.batching import pack
from orlhf.config import WorkerConfig
from orlhf.types import Experience, SequenceBatch, TrainStats
from orlhf.workers.base import DeepSpeedWorker, position_ids_from
from orlhf.workers.loading import from_pretrained

log = logging.getLogger("orlhf.workers")


def load_causal_lm(cfg: WorkerConfig) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = from_pretrained(AutoModelForCausalLM, cfg.model_path, cfg)
    model.config.use_cache = False  # training and scoring never reuse a KV cache
    return model


def action_logits(model: nn.Module, batch: SequenceBatch, temperature: float, packed: bool = False) -> torch.Tensor:
    """(B, A, V) float32 logits / temperature that score the A action tokens (positions T-A-1 .. T-2).

    packed: run the batch as one row of real tokens (orlhf/batching.py); zeros where there is no action token.
    """
    if packed:
        return _packed_action_logits(model, batch) / temperature
    num_actions = batch.num_actions
    kwargs = {}
    if _accepts_logits_to_keep(model):  # the LM head then runs on A+1 positions only, not all T
        kwargs["logits_to_keep"] = num_actions + 1
    out = model(input_ids=batch.sequences, attention_mask=batch.attention_mask,
                position_ids=position_ids_from(batch.attention_mask), use_cache=False, **kwargs)
    return out.logits[:, -num_actions - 1:-1].float() / temperature


def _packed_action_logits(model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    p = pack(batch)
    keep = _accepts_logits_to_keep(model)
    # attention_mask=None: transformers reads the sample boundaries from position_ids (varlen / block mask)
    out = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False,
                **({"logits_to_keep": p.score_index} if keep else {}))
    logits = out.logits[0] if keep else out.logits[0, p.score_index]
    return p.unflatten(logits.float())


def gather_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materializing the (B, A, V) log-softmax: (B, A)."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    module = getattr(model, "module", model)  # a DeepSpeedEngine forwards kwargs to its module
    return _forward_takes_logits_to_keep(type(module))


@functools.lru_cache(maxsize=None)
def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _log_probs(worker: DeepSpeedWorker, batch: SequenceBatch) -> torch.Tensor:
    def fn(mb: SequenceBatch) -> torch.Tensor:
        logits = action_logits(worker.engine, mb, worker.cfg.temperature, worker.cfg.packing_samples)
        return gather_log_probs(logits, mb.sequences[:, -mb.num_actions:])

    return worker.forward_micro_batches(batch, fn)


class ReferenceWorker(DeepSpeedWorker):
    """The frozen reference policy: log-probs only (ZeRO inference, eval mode)."""

    def build_model(self) -> nn.Module:
        return load_causal_lm(self.cfg)

    def log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log pi_ref of each action token (padding positions hold garbage: mask them)."""
        return _log_probs(self, batch)


class PolicyWorker(DeepSpeedWorker):
    """The actor: log-probs for experience making, PPO train steps, full weights for the engines."""

    def build_model(self) -> nn.Module:
        return load_causal_lm(self.cfg)

    def log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log pi of each action token under the current weights."""
        self.engine.eval()
        return _log_probs(self, batch)

    def train_step(self, batch: Experience) -> TrainStats:
        """PPO on this rank's share: len(batch) must be a multiple of train_batch_size / world."""
        if self.cfg.use_kl_loss and batch.base_action_log_probs is None:
            raise ValueError("use_kl_loss needs Experience.base_action_log_probs (the reference log-probs)")
        return self.train_micro_batches(batch, self._loss)

    def _loss(self, mb: Experience) -> tuple[torch.Tensor, dict]:
        cfg, mask = self.cfg, mb.action_mask
        logits = action_logits(self.engine, mb.as_sequence_batch(), cfg.temperature, cfg.packing_samples)  # (b, A, V)
        log_probs = gather_log_probs(logits, mb.sequences[:, -mb.num_actions:])  # (b, A)
        loss, clip_frac = policy_loss(log_probs, mb.action_log_probs, mb.advantages, mask, cfg.eps_clip, cfg.dual_clip)
        stats = {"loss": loss.item(), "clip_frac": clip_frac.item(),
                 "approx_kl": masked_mean(mb.action_log_probs - log_probs.detach(), mask).item()}
        if cfg.entropy_loss_coef > 0:
            entropy = masked_mean(entropy_from_logits(logits), mask)
            loss = loss - cfg.entropy_loss_coef * entropy
            stats["entropy"] = entropy.item()
        else:  # logged either way (the run report plots it); no graph when it is not a loss term
            with torch.no_grad():
                stats["entropy"] = masked_mean(entropy_from_logits(logits.detach()), mask).item()
        if cfg.use_kl_loss:
            kl = masked_mean(approx_kl(log_probs, mb.base_action_log_probs, cfg.kl_estimator), mask)
            loss = loss + cfg.kl_coef * kl
            stats["kl_loss"] = kl.item()
        return loss, stats

    # ---- weight sync: orlhf/weight_sync.py drives these; only rank 0 talks to the engines ----

    def weight_groups_meta(self) -> list[list[tuple[str, str, tuple]]]:
        """(hf name, dtype, full shape) per group, in named_full_weights order. Local: no gather needed."""
        return [[(n, str(p.dtype), tuple(getattr(p, "ds_shape", p.shape))) for n, p in group]
                for group in self._param_groups()]

    def sync_address(self) -> tuple[str, int]:
        """An address on this rank's node for the trainer -> engines group (rank 0 hosts its store)."""
        import ray

        from orlhf.cluster import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_weight_sender(self, host: str, port: int, world_size: int, backend: str) -> None:
        from orlhf.weight_sync import WeightSender

        self._sender = WeightSender(host, port, world_size, backend, self.device) if self.rank == 0 else None

    def send_weights(self, expected: int) -> int:
        """All ranks walk the gathered groups (collective); rank 0 broadcasts each tensor to the engines."""
        from orlhf.weight_sync import send_groups

        sender = getattr(self, "_sender", None)
        if self.rank == 0 and sender is None:
            raise RuntimeError("send_weights before init_weight_sender: the engines would wait forever")
        return send_groups(sender, self.named_full_weights(to_cpu=False, copy=False), expected)

    def init_ipc_sync(self, engine, tp: int) -> None:
        """Colocated on GPUs: remember this rank's engine (the one sharing its GPU) for send_weights_ipc."""
        self._ipc_engine, self._ipc_tp = engine, tp

    def send_weights_ipc(self) -> int:
        from orlhf.weight_sync import send_ipc

        return send_ipc(self, self._ipc_engine, self._ipc_tp)

    def save_hf(self, out_dir: str) -> None:
        """Write an HF folder (weights in the module dtype, config, tokenizer) that transformers and vLLM load.

        Collective under ZeRO-3 (all ranks call it); rank 0 writes; returns on every rank after the write.
        """
        import torch.distributed as dist

        state: dict[str, torch.Tensor] = {}
        for group in self.named_full_weights():
            state.update({n: t for n, t in group if t is not None})
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            self.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            _copy_tokenizer(self.cfg.model_path, out_dir)
        if self.world_size > 1:
            dist.barrier()


def _copy_tokenizer(src: str, out_dir: str) -> Optional[str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:  # a weights-only folder: the export is still a loadable model
        log.warning("no tokenizer in %s (%s); %s gets weights and config only", src, e, out_dir)
        return None
    tokenizer.save_pretrained(out_dir)
    return out_dir
