"""Causal-LM workers: the reference (ReferenceWorker, frozen) and the actor (PolicyWorker: the reference's model
building, init and scoring, plus PPO training and weight export).

Both score the same thing, log pi(a_t | s_<t) for the last A tokens of each sequence:

    sequences (B, T) --model(position_ids from attention_mask)--> logits of positions T-A-1 .. T-2 (B, A, V)
        / temperature --log-softmax, gather sequences[:, -A:]--> log_probs (B, A)

where rows share a prompt (n samples per prompt) the model runs each distinct prompt once and only the response
columns per row, the same logits (workers/shared_prompt.py; checked per worker at init, --no_shared_prompt: off).

The actor's train_step is OpenRLHF's PPO actor step, per micro-batch (algo/losses.py for the terms):
    loss = agg(policy_loss_terms(log pi, log pi_old, A, ...))   clipped surrogate (ppo | gspo, IS correction)
         - entropy_loss_coef * agg(entropy)                     (if > 0; entropy is logged either way)
         + kl_coef * agg(approx_kl(log pi, log pi_ref))         (if use_kl_loss; kl_coef from the controller)
agg is the step-global token (or sequence) mean: each micro-batch divides by its optimizer step's counts.
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
from orlhf.algo.logprobs import token_log_probs, token_log_probs_entropy, window
from orlhf.algo.losses import LossNorm, aggregate, entropy_from_logits, masked_mean, policy_loss_terms
from orlhf.config.worker_config import WorkerConfig
from orlhf.distributed.endpoints import endpoint
from orlhf.types import Experience, Rollout, SamplingSpec, SequenceBatch, TrainStats
from orlhf.workers import generation
from orlhf.workers.base import DeepSpeedWorker, position_ids_from
from orlhf.workers.batching import pack
from orlhf.workers.lm_head import chunked_head, head_log_probs, hidden_states_out
from orlhf.workers.loading import from_pretrained
from orlhf.workers.shared_prompt import shared_prompt_forward, worker_shares_prompts

log = logging.getLogger("orlhf.workers")


def load_causal_lm(cfg: WorkerConfig) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = from_pretrained(AutoModelForCausalLM, cfg.model_path, cfg)
    model.config.use_cache = False  # training and scoring never reuse a KV cache
    return model


def action_logits(
    model: nn.Module, batch: SequenceBatch, temperature: float, packed: bool = False, shared: bool = False
) -> torch.Tensor:
    """(B, A, V) float32 logits / temperature that score the A action tokens (positions T-A-1 .. T-2).

    packed: run the batch as one row of real tokens (orlhf/workers/batching.py); zeros where there is no action token.
    """
    logits, offset = model_logits(model, batch, packed, shared)
    return window(logits, offset, batch.num_actions, temperature)


def model_logits(
    model: nn.Module, batch: SequenceBatch, packed: bool = False, shared: bool = False
) -> tuple[torch.Tensor, int]:
    """(logits (B, L, V) as the model returns them, offset): the action tokens' logits are [:, offset:offset + A].
    Left unsliced so that token_log_probs' backward writes the whole gradient at once (orlhf/algo/logprobs.py).

    shared: run each distinct prompt once for all rows that share it (workers/shared_prompt.py), when some do."""
    if packed:
        return _packed_action_logits(model, batch), 0
    num_actions = batch.num_actions
    keep = _accepts_logits_to_keep(model)
    position_ids = position_ids_from(batch.attention_mask)
    logits = shared_action_logits(model, batch, position_ids, keep) if shared else None
    if logits is not None:
        return logits, 0
    kwargs = {}
    if keep:  # the LM head then runs on A+1 positions only, not all T
        kwargs["logits_to_keep"] = num_actions + 1
    out = model(
        input_ids=batch.sequences,
        attention_mask=batch.attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    return out.logits, out.logits.shape[1] - num_actions - 1


def shared_action_logits(
    model: nn.Module, batch: SequenceBatch, position_ids: Optional[torch.Tensor] = None, keep: Optional[bool] = None
) -> Optional[torch.Tensor]:
    """(B, A, V) logits scoring the A action tokens with each distinct prompt run once (workers/shared_prompt.py),
    or None where that does not apply (no prompt shared, or the model keeps no cache)."""
    keep = _accepts_logits_to_keep(model) if keep is None else keep

    def run(ids, mask, pos, cache):  # the prefix pass needs no logits: the LM head on one column
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **({"logits_to_keep": 1} if keep and cache is None else {}),
        )
        return out.logits, getattr(out, "past_key_values", None)

    if position_ids is None:
        position_ids = position_ids_from(batch.attention_mask)
    return shared_prompt_forward(run, batch, position_ids)


def _packed_action_logits(model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    p = pack(batch)
    keep = _accepts_logits_to_keep(model)
    # attention_mask=None: transformers reads the sample boundaries from position_ids (varlen / block mask)
    out = model(
        input_ids=p.input_ids,
        position_ids=p.position_ids,
        attention_mask=None,
        use_cache=False,
        **({"logits_to_keep": p.score_index} if keep else {}),
    )
    logits = out.logits[0] if keep else out.logits[0, p.score_index]
    return p.unflatten(logits.float())


def gather_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materializing the (B, A, V) log-softmax: (B, A)."""
    return token_log_probs(logits, tokens)


def action_log_probs(
    model: nn.Module,
    batch: SequenceBatch,
    temperature: float,
    packed: bool = False,
    shared: bool = False,
    chunk_mb: float = 0.0,
) -> torch.Tensor:
    """(B, A) log pi of the action tokens, through token_log_probs' one-pass backward (or a chunk of tokens at a
    time: chunked_action_log_probs)."""
    chunked = chunked_action_log_probs(model, batch, temperature, packed, shared, chunk_mb)
    if chunked is not None:
        return chunked[0]
    logits, offset = model_logits(model, batch, packed, shared)
    return token_log_probs(logits, batch.sequences[:, -batch.num_actions :], offset, temperature)


def action_log_probs_entropy(
    model: nn.Module,
    batch: SequenceBatch,
    temperature: float,
    packed: bool = False,
    shared: bool = False,
    chunk_mb: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, A) log pi of the action tokens as action_log_probs, (B, A) entropy of each action position's
    distribution, detached: for the log, from the softmax the log-probs' backward keeps anyway)."""
    chunked = chunked_action_log_probs(model, batch, temperature, packed, shared, chunk_mb)
    if chunked is not None:
        return chunked[0], chunked[1].detach()
    logits, offset = model_logits(model, batch, packed, shared)
    return token_log_probs_entropy(logits, batch.sequences[:, -batch.num_actions :], offset, temperature)


def chunked_action_log_probs(
    model: nn.Module, batch: SequenceBatch, temperature: float, packed: bool, shared: bool, chunk_mb: float
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """((B, A) log-probs, (B, A) entropy), both in the graph, from the last hidden states and the LM head a chunk
    of tokens at a time (workers/lm_head.py), when the micro-batch's whole logits would exceed --logprobs_chunk_mb;
    None: the whole logits (small batches or vocabularies, models that change the logits after the head)."""
    found = chunked_head(model, batch.sequences.shape[0] * batch.num_actions, chunk_mb)
    if found is None:
        return None
    head, rows = found
    with hidden_states_out(head):
        hidden, offset = model_logits(model, batch, packed, shared)  # every path's slicing, on hidden states
    a = batch.num_actions
    return head_log_probs(head, hidden[:, offset : offset + a], batch.sequences[:, -a:], temperature, rows)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    module = getattr(model, "module", model)  # a DeepSpeedEngine forwards kwargs to its module
    if hasattr(module, "get_base_model"):  # a peft model passes unknown kwargs on to the transformers model
        module = module.get_base_model()
    return _forward_takes_logits_to_keep(type(module))


@functools.lru_cache(maxsize=None)
def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def shares_prompts(worker: DeepSpeedWorker) -> bool:
    """Whether this causal-LM worker runs each distinct prompt once per forward (workers/shared_prompt.py)."""
    return worker_shares_prompts(
        worker, lambda b: action_logits(worker.engine, b, 1.0), lambda b: shared_action_logits(worker.engine, b)
    )


class CausalLMWorker(DeepSpeedWorker):
    """What the actor and the reference share: the same causal LM, built, initialised and scored the same way."""

    def build_model(self) -> nn.Module:
        model = load_causal_lm(self.cfg)
        loss = getattr(self.cfg, "loss", None)
        if loss is not None and loss.aux_loss_coef > 0:  # the actor with --aux_loss_coef: MoE routers' aux loss
            model.config.output_router_logits = True
            model.register_forward_hook(self._record_aux_loss)
        lora = getattr(self.cfg, "lora", None)
        if lora is None:
            return model
        from orlhf.workers.lora import apply_lora

        return apply_lora(model, lora)

    def _record_aux_loss(self, module: nn.Module, args, output) -> None:
        """Forward hook of the transformers model: its last forward's router load-balancing loss (a tensor in the
        graph), which the actor's loss adds (--aux_loss_coef)."""
        self.last_aux_loss = getattr(output, "aux_loss", None)

    @endpoint
    def init(self) -> None:
        """Collective: all ranks call it together. Not with --aux_loss_coef: the router loss transformers computes
        needs whole rows in one forward (its padding mask does not fit a forward continued from a prompt's cache)."""
        super().init()
        aux = getattr(getattr(self.cfg, "loss", None), "aux_loss_coef", 0.0) > 0
        self.shared_prompt = False if aux else shares_prompts(self)

    def score_log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log-probs of each action token (padding positions hold garbage: mask them)."""

        def fn(mb: SequenceBatch) -> torch.Tensor:
            c = self.cfg
            return action_log_probs(
                self.engine, mb, c.temperature, c.packing_samples, self.shared_prompt, c.logprobs_chunk_mb
            )

        return self.forward_micro_batches(batch, fn)


class ReferenceWorker(CausalLMWorker):
    """The frozen reference policy: log-probs only (ZeRO inference, eval mode)."""

    @endpoint
    def log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log pi_ref of each action token (padding positions hold garbage: mask them)."""
        return self.score_log_probs(batch)


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
        """(B, A) float32 on CPU: log pi of each action token under the current weights."""
        self.engine.eval()  # train_step leaves the engine in train mode
        return self.score_log_probs(batch)

    @endpoint
    def base_log_probs(self, batch: SequenceBatch) -> torch.Tensor:
        """(B, A) float32 on CPU: log-probs under the base weights with the LoRA adapter off: the reference policy,
        from the actor's own ranks (TrainConfig.reference_from_actor)."""
        from orlhf.workers.lora import adapter_off

        self.engine.eval()
        with adapter_off(self.module):
            return self.score_log_probs(batch)

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

    # ---- weight sync: orlhf/trainer/weight_sync.py drives these, workers/weight_send.py does the sending; only rank 0
    # talks to the engines (broadcast) ----

    @endpoint
    def weight_groups_meta(self, packed: Optional[dict] = None) -> list[list[tuple[str, str, tuple]]]:
        """(checkpoint name, dtype, full shape) per group, in the order sync_groups yields them. Local: no gather.
        Every rank calls it before the first sync: with LoRA it fixes what a sync sends (the adapted modules and
        the ones the engine fuses with them; `packed`: the engine model's packed_modules_mapping, workers/lora.py)."""
        if self.lora is None:
            return self.checkpoint_groups_meta()
        from orlhf.workers.lora import merged_groups_meta, sync_plan

        self._sync_plan = sync_plan(self.module, packed)
        return merged_groups_meta(self, self._sync_plan)

    @property
    def lora(self):
        return self.cfg.lora

    def sync_groups(self, to_cpu: bool, copy: bool, all_ranks: bool = False):
        """What the engines load, one group of whole layers at a time (named_full_weights' contract): every weight,
        or with LoRA the adapted modules merged (workers/lora.py; weight_groups_meta chose them)."""
        if self.lora is None:
            return self.named_full_weights(to_cpu=to_cpu, copy=copy, all_ranks=all_ranks)
        from orlhf.workers.lora import merged_groups

        if getattr(self, "_sync_plan", None) is None:
            raise RuntimeError("a LoRA weight sync before weight_groups_meta: the modules to send are not chosen")
        return merged_groups(self, self._sync_plan, to_cpu=to_cpu, all_ranks=all_ranks)

    @endpoint
    def sync_address(self) -> tuple[str, int]:
        """An address on this rank's node for the trainer -> engines group (rank 0 hosts its store)."""
        import ray

        from orlhf.distributed.groups import free_port

        return ray.util.get_node_ip_address(), free_port()

    @endpoint
    def init_weight_sender(self, host: str, port: int, world_size: int, backend: str, timeout_s: float = 300.0) -> None:
        """Rank 0 hosts the group's store and joins as rank 0; timeout_s: how long the store waits for every member
        (--ray_timeout_s)."""
        from orlhf.workers.weight_send import WeightSender

        self._sender = None  # a fresh group replaces the old one (an engine was replaced): its end is dropped first
        self._sender = WeightSender(host, port, world_size, backend, self.device, timeout_s) if self.rank == 0 else None

    @endpoint
    def close_weight_sender(self) -> None:
        """Drop rank 0's end of the group after a failed sync, so the engine workers still waiting in it fail out."""
        self._sender = None

    @endpoint
    def send_weights(self, expected: int) -> int:
        """All ranks walk the gathered groups (collective); rank 0 broadcasts each tensor to the engines."""
        from orlhf.workers.weight_send import send_groups

        sender = getattr(self, "_sender", None)
        if self.rank == 0 and sender is None:
            raise RuntimeError("send_weights before init_weight_sender: the engines would wait forever")
        return send_groups(sender, self.sync_groups(to_cpu=False, copy=False), expected)

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
        """Write an HF folder (weights in the module dtype, config, tokenizer) that transformers and vLLM load; with
        LoRA the adapter in PEFT's format (loads with PeftModel.from_pretrained on the base model).

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
            _copy_tokenizer(self.cfg.model_path, out_dir)
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


def _copy_tokenizer(src: str, out_dir: str) -> Optional[str]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:  # a weights-only folder: the export is still a loadable model
        log.warning("no tokenizer in %s (%s); %s gets weights and config only", src, e, out_dir)
        return None
    tokenizer.save_pretrained(out_dir)
    return out_dir
