"""The actor (PolicyWorker): the reference's model building, init and scoring (workers/causal_lm.py), plus PPO
training, generation inside its ranks (--rollout_backend trainer) and weight export.

The actor's train_step is OpenRLHF's PPO actor step, per micro-batch (algo/losses.py for the terms):
    loss = agg(policy_loss_terms(log pi, log pi_old, A, ...))   clipped surrogate (ppo | gspo, IS correction)
         - entropy_loss_coef * agg(entropy)                     (if > 0; entropy is logged either way)
         + kl_coef * agg(approx_kl(log pi, log pi_ref))         (if use_kl_loss; kl_coef from the controller)
agg is the step-global token (or sequence) mean: each micro-batch divides by its optimizer step's counts.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import replace
from typing import Optional

import torch

from orlhf.algo.kl import approx_kl
from orlhf.algo.losses import LossNorm, aggregate, entropy_from_logits, masked_mean, policy_loss_terms
from orlhf.distributed.endpoints import endpoint
from orlhf.types import Experience, Rollout, SamplingSpec, SequenceBatch, TrainStats
from orlhf.workers import generation
from orlhf.workers.causal_lm import (
    CausalLMWorker,
    action_log_probs_entropy,
    action_logits,
    chunked_action_log_probs,
    gather_log_probs,
)
from orlhf.workers.loading import is_vision_language
from orlhf.workers.router_replay import replay_of

log = logging.getLogger("orlhf.workers")


class PolicyWorker(CausalLMWorker):
    """The actor: log-probs for experience making, PPO train steps, full weights for the engines."""

    @endpoint
    def init(self) -> None:
        """Collective: all ranks call it together. With --enable_ema the average starts from these weights."""
        super().init()
        self._ema = None
        if self.cfg.ema_beta is not None:
            from orlhf.workers.ema import EmaWeights

            self._ema = EmaWeights(self.module.named_parameters(), self.cfg.ema_beta, self.rank, self.zero3)

    def after_optimizer_step(self) -> None:
        if self._ema is not None:
            self._ema.update()

    def checkpoint_extras(self) -> Optional[dict[str, torch.Tensor]]:
        """What this rank's checkpoint holds besides DeepSpeed's state (workers/checkpoint_io.py): the EMA, rank 0's
        ({} elsewhere); None without one."""
        return None if self._ema is None else {f"ema/{n}": t for n, t in self._ema.state().items()}

    def load_checkpoint_extras(self, extras: Optional[dict[str, torch.Tensor]]) -> None:
        if self._ema is not None:
            got = None if extras is None else {n.removeprefix("ema/"): t for n, t in extras.items()}
            self._ema.load(got)

    @endpoint
    def log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log pi of each action token under the current weights. --router_replay R3: routed
        as the engines routed the batch; R2: the routers' own choice, recorded for recorded_routing."""
        self.engine.eval()  # train_step leaves the engine in train mode
        replay = replay_of(self.engine)
        if replay is None or replay.mode != "R2":
            return self.score_log_probs(batch)
        with replay.recording_into(batch) as slotted:
            return self.score_log_probs(slotted)

    @endpoint
    def recorded_routing(self) -> torch.Tensor:
        """--router_replay R2: (B, T, L, K) int16, the experts the last log_probs call routed its batch's tokens to."""
        replay = replay_of(self.engine)
        out, replay.recorded = replay.recorded, None
        return out

    @endpoint
    def base_log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log-probs under the base weights with the LoRA adapter off: the reference policy,
        from the actor's own ranks (TrainConfig.reference_from_actor). It keeps its own routing (docs/moe.md)."""
        from orlhf.workers.lora import adapter_off

        self.engine.eval()
        with adapter_off(self.module):
            return self.score_log_probs(replace(batch, routing=None))

    @endpoint
    def log_probs_and_base(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, 2, A): [:, 0] log_probs (current weights), [:, 1] base_log_probs (adapter off), in one call so the two
        forwards never run at once on a rank (a rank actor runs two calls at a time)."""
        return torch.stack([self.log_probs(batch), self.base_log_probs(batch)], dim=1)

    @endpoint
    def generate(self, prompts: list, spec: SamplingSpec, pad_id: int, eos_id: Optional[int]) -> list[Rollout]:
        """--rollout_backend trainer: spec.n rollouts of each (prompt index, ids), sampled on this rank's weights
        (workers/generation.py). Collective under ZeRO-3: every rank calls, with or without prompts."""
        return generation.rollouts(self, prompts, spec, pad_id, eos_id)

    @endpoint
    def generate_tokens(self, requests: list, pad_id: int, eos_id: Optional[int]) -> list[tuple]:
        """--rollout_backend trainer with agents: (ids, SamplingParams) -> (new ids, log-probs, finish reason)."""
        return generation.turns(self, requests, pad_id, eos_id)

    @endpoint
    def train_step(self, batch: Experience, kl_coef: Optional[float] = None) -> TrainStats:
        """PPO on this rank's share: len(batch) must be a multiple of train_batch_size / world.

        kl_coef: the KL-loss coefficient for this step (the controller's adaptive value); None: cfg.loss.kl_coef.
        """
        if self.cfg.loss.use_kl_loss and batch.base_action_log_probs is None:
            raise ValueError("use_kl_loss needs Experience.base_action_log_probs (the reference log-probs)")
        coef = self.cfg.loss.kl_coef if kl_coef is None else float(kl_coef)
        if replay_of(self.engine) is not None:
            replay_of(self.engine).take_stats()  # the routing statistics are the training forwards' own
        stats = self.train_micro_batches(batch, functools.partial(self._loss, kl_coef=coef))
        stats.kl_coef = coef
        return stats

    def _loss(self, mb: Experience, norm: LossNorm, kl_coef: float) -> tuple[torch.Tensor, dict]:
        cfg, lc, mask = self.cfg, self.cfg.loss, mb.action_mask
        seqs = mb.as_sequence_batch()
        how = (cfg.temperature, cfg.packing_samples, self.shared_prompt_train)
        chunked = chunked_action_log_probs(self.engine, seqs, *how, cfg.logprobs_chunk_mb)
        if chunked is not None:  # the entropy is in the graph either way; detached below when only logged
            log_probs, entropy = chunked if lc.entropy_loss_coef > 0 else (chunked[0], chunked[1].detach())
        elif lc.entropy_loss_coef > 0:  # entropy joins the graph: (b, A, V) logits / temperature with grad
            logits = action_logits(self.engine, seqs, *how)
            log_probs = gather_log_probs(logits, mb.sequences[:, -mb.num_actions :])  # (b, A)
            entropy = entropy_from_logits(logits)  # (b, A), in the graph
        else:  # entropy is only logged: detached, from the log-probs' own softmax
            log_probs, entropy = action_log_probs_entropy(self.engine, seqs, *how)
        aux = getattr(self, "last_aux_loss", None) if lc.aux_loss_coef > 0 else None  # this forward's (MoE)
        old = _old_log_probs(mb, log_probs)
        terms = policy_loss_terms(
            log_probs,
            old,
            mb.advantages,
            mask,
            lc.eps_clip,
            lc.eps_clip_high if lc.eps_clip_high is not None else lc.eps_clip,
            lc.dual_clip,
            lc.policy_loss_type,
            mb.rollout_log_probs,
            lc.is_spec,
        )
        loss = aggregate(terms.loss, mask, lc.loss_agg_mode, norm)
        cut = terms.clipped_low | terms.clipped_high | terms.dual_clipped
        # Losses are logged as this micro-batch's own aggregate, in the mode they are optimized in (the step's
        # stats are means over micro-batches); `loss` itself is scaled for DeepSpeed (LossNorm) and is no figure.
        stats = {
            "loss": aggregate(terms.loss.detach(), mask, lc.loss_agg_mode).item(),
            "clip_frac": masked_mean(cut.float(), mask).item(),
            "clip_frac_low": masked_mean(terms.clipped_low.float(), mask).item(),
            "clip_frac_high": masked_mean(terms.clipped_high.float(), mask).item(),
            "approx_kl": masked_mean(old - log_probs.detach(), mask).item(),
            **_engine_gap_sums(mb, log_probs),
            **_routing_sums(self.engine, mb),
        }
        if terms.is_cut is not None:
            stats["is_cut_frac"] = _is_cut_share(terms.is_cut, mask, lc.is_level)
        side_agg = lc.kl_entropy_agg_mode or lc.loss_agg_mode  # the KL-loss and entropy terms'
        # Entropy is logged on every step; it joins the graph only when it is in the loss.
        if lc.entropy_loss_coef > 0:
            loss = loss - lc.entropy_loss_coef * aggregate(entropy, mask, side_agg, norm)
        stats["entropy"] = masked_mean(entropy.detach(), mask).item()
        if lc.use_kl_loss:
            kl = approx_kl(log_probs, mb.base_action_log_probs, lc.kl_estimator, old, lc.kl_unbiased_gradient)
            loss = loss + kl_coef * aggregate(kl, mask, side_agg, norm)
            stats["kl_loss"] = aggregate(kl.detach(), mask, side_agg).item()
        if aux is not None:  # per micro-batch, unscaled, as OpenRLHF adds output.aux_loss * aux_loss_coef
            loss = loss + lc.aux_loss_coef * aux
            stats["aux_loss"] = aux.item()
        return loss, stats

    # ---- weight sync: orlhf/rollout/weight_sync.py drives these, workers/weight_send.py does the sending; only rank 0
    # talks to the engines (broadcast) ----

    @endpoint
    def weight_groups_meta(self, packed: Optional[dict] = None) -> list[list[tuple[str, str, tuple]]]:
        """(checkpoint name, dtype, full shape) per group, in the order sync_groups yields them. Local: no gather.
        Every rank calls it before the first sync: with LoRA it fixes what a sync sends (the adapted modules and
        the ones the engine fuses with them; `packed`: the engine model's packed_modules_mapping, workers/lora.py).
        With --freeze_visual_encoder the frozen parameters are left out: the engines loaded them from the same
        folder and they never change."""
        if self.lora is None:
            return self.checkpoint_groups_meta(trained_only=self.cfg.freeze_visual_encoder)
        from orlhf.workers.lora import merged_groups_meta, sync_plan

        self._sync_plan = sync_plan(self.module, packed)
        return merged_groups_meta(self, self._sync_plan)

    @property
    def lora(self):
        return self.cfg.lora

    def sync_groups(self, to_cpu: bool, copy: bool, all_ranks: bool = False):
        """What the engines load, one group of whole layers at a time (named_full_weights' contract): every weight
        (but the frozen ones with --freeze_visual_encoder), or with LoRA the adapted modules merged
        (workers/lora.py; weight_groups_meta chose them)."""
        if self.lora is None:
            trained_only = self.cfg.freeze_visual_encoder
            return self.named_full_weights(to_cpu=to_cpu, copy=copy, all_ranks=all_ranks, trained_only=trained_only)
        from orlhf.workers.lora import merged_groups

        if getattr(self, "_sync_plan", None) is None:
            raise RuntimeError("a LoRA weight sync before weight_groups_meta: the modules to send are not chosen")
        return merged_groups(self, self._sync_plan, to_cpu=to_cpu, all_ranks=all_ranks)

    @endpoint
    def sync_address(self) -> tuple[str, int]:
        """The address the engines reach this rank at (distributed/addresses.py) and a free port there, for the
        trainer -> engines group (rank 0 hosts its store)."""
        from orlhf.distributed.addresses import free_port, local_address

        return local_address(), free_port()

    @endpoint
    def init_weight_sender(
        self,
        host: Optional[str],
        port: Optional[int],
        world_size: int,
        backend: str,
        timeout_s: float = 300.0,
        ray_group: Optional[str] = None,
    ) -> None:
        """Rank 0 hosts the group's store and joins as rank 0 (or joins the Ray collective group `ray_group`:
        --vllm_sync_with_ray); timeout_s: how long it waits for every member (--ray_timeout_s)."""
        from orlhf.workers.weight_send import WeightSender

        self.close_weight_sender()  # a fresh group replaces the old one (an engine was replaced): its end goes first
        if self.rank == 0:
            self._sender = WeightSender(host, port, world_size, backend, self.device, timeout_s, ray_group)

    @endpoint
    def close_weight_sender(self) -> None:
        """Drop rank 0's end of the group after a failed sync, so the engine workers still waiting in it fail out."""
        sender, self._sender = getattr(self, "_sender", None), None
        if sender is not None:
            sender.close()

    @endpoint
    def send_weights(self, expected: int) -> int:
        """All ranks walk the gathered groups (collective); rank 0 broadcasts each tensor to the engines."""
        from orlhf.workers.weight_send import send_groups

        sender = getattr(self, "_sender", None)
        if self.rank == 0 and sender is None:
            raise RuntimeError("send_weights before init_weight_sender: the engines would wait forever")
        return send_groups(sender, self.sync_groups(to_cpu=False, copy=False), expected)

    @endpoint
    def send_weights_delta(self, bucket_sizes: list[int], dtype: str, full: bool) -> int:
        """--vllm_sync_delta: as send_weights, but rank 0 broadcasts only what changed in the engines' `dtype` since
        the last sync (workers/weight_send.py: send_groups_delta); full: everything, the held copy rebuilt. Returns
        the bytes broadcast (rank 0; 0 elsewhere)."""
        from orlhf.workers.weight_send import send_groups_delta

        sender = getattr(self, "_sender", None)
        if self.rank == 0 and sender is None:
            raise RuntimeError("send_weights_delta before init_weight_sender: the engines would wait forever")
        groups = self.sync_groups(to_cpu=False, copy=False)
        return send_groups_delta(sender, groups, bucket_sizes, getattr(torch, dtype), full)

    @endpoint
    def init_ipc_sync(self, engine, tp: int) -> None:
        """Colocated on GPUs: remember this rank's engine (an EngineGroup of the one engine sharing its GPU)
        for send_weights_ipc."""
        self._ipc_engine, self._ipc_tp = engine, tp

    @endpoint
    def send_weights_ipc(self) -> int:
        from orlhf.workers.weight_send import send_ipc

        return send_ipc(self, self._ipc_engine, self._ipc_tp)

    @endpoint
    def save_hf(self, out_dir: str) -> None:
        """Write an HF folder (weights in the module dtype, config, tokenizer; a vision-language model's whole
        processor) that transformers and vLLM load; with LoRA the adapter in PEFT's format (loads with
        PeftModel.from_pretrained on the base model).

        Collective under ZeRO-3 (all ranks call it); rank 0 writes; returns on every rank after the write.
        """
        self._save_folder(out_dir, merged=False)

    @endpoint
    def save_hf_merged(self, out_dir: str) -> None:
        """With LoRA: the adapter merged into the base weights, a plain HF folder (--lora_save_merged). Collective."""
        self._save_folder(out_dir, merged=True)

    def _save_folder(self, out_dir: str, merged: bool) -> None:
        """The weights exported are the EMA's with --enable_ema (as OpenRLHF exports its EMA model)."""
        import torch.distributed as dist

        state: dict[str, torch.Tensor] = {}
        for group in self.named_full_weights(checkpoint_format=False):  # save_pretrained converts names itself
            state.update({n: t for n, t in group if t is not None})
        if self.rank == 0 and getattr(self, "_ema", None) is not None:
            state = self._ema.averaged(state)
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            if self.lora is None:
                self.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            else:
                from orlhf.workers import lora

                if merged:
                    base = lora.base_hf_model(self.module)
                    base.save_pretrained(
                        out_dir, state_dict=lora.merged_state(self.module, state), safe_serialization=True
                    )
                else:
                    lora.save_adapter(self.module, state, out_dir)
            _copy_tokenizer(
                self.cfg.model_path, out_dir, vision=is_vision_language(getattr(self.module, "config", None))
            )
        if self.world_size > 1:
            dist.barrier()


def _old_log_probs(mb: Experience, log_probs: torch.Tensor) -> torch.Tensor:
    """log pi_old: the experience's, or on a single pass (action_log_probs None: one optimizer step per batch, so
    the weights here are the ones that would have scored it) this forward's own, detached: ratio exactly 1,
    gradient that of log pi, as with a separately recomputed pi_old equal up to float rounding."""
    return mb.action_log_probs if mb.action_log_probs is not None else log_probs.detach()


def _is_cut_share(is_cut: torch.Tensor, mask: torch.Tensor, level: str) -> float:
    """The share of IS-correction units clipped or masked, at their own granularity (OpenRLHF 0.11.2's
    is_filter_ratio): tokens, or at seq level the sequences with a real token."""
    if level != "seq":
        return masked_mean(is_cut.float(), mask).item()
    real = mask.any(-1)
    return (is_cut.any(-1) & real).sum().item() / max(int(real.sum().item()), 1)


def _engine_gap_sums(mb: Experience, log_probs: torch.Tensor) -> dict[str, float]:
    """Sum |engine - trainer log-prob| and token count (engine_logprob_gap) when the engines' log-probs came along."""
    if mb.rollout_log_probs is None:
        return {}
    mask = mb.action_mask
    gap = ((mb.rollout_log_probs - log_probs.detach()).abs() * mask).sum()
    return {"engine_gap_sum": gap.item(), "engine_gap_tokens": float(mask.sum().item())}


def _routing_sums(engine, mb: Experience) -> dict[str, float]:
    """--router_replay: the tokens scoring the response that this forward replayed, those among them whose experts
    the routers would have chosen otherwise (routing_mismatch_frac), and all of them (routing_replayed_frac)."""
    replay = replay_of(engine)
    if replay is None:
        return {}
    return {**replay.take_stats(), "routing_response_tokens": float(mb.action_mask.sum().item())}


def _copy_tokenizer(src: str, out_dir: str, vision: bool = False) -> Optional[str]:
    """The tokenizer's files from `src` into `out_dir`; vision: the whole processor's (image processor settings,
    chat template, tokenizer), so AutoProcessor.from_pretrained(out_dir) gives what the run used."""
    from transformers import AutoProcessor, AutoTokenizer

    what = "processor" if vision else "tokenizer"
    try:
        tokenizer = (AutoProcessor if vision else AutoTokenizer).from_pretrained(src)
    except (OSError, ValueError) as e:  # a weights-only folder: the export is still a loadable model
        log.warning("no %s in %s (%s); %s gets weights and config only", what, src, e, out_dir)
        return None
    tokenizer.save_pretrained(out_dir)
    return out_dir
