"""Causal-LM scoring and the workers built on it: the forward paths (plain, each distinct prompt once, packed; log-probs
from whole logits or from the LM head in chunks), CausalLMWorker (model building, init and scoring shared by the
actor and the reference) and ReferenceWorker (frozen). The actor, PolicyWorker, is in workers/policy.py.

Both score the same thing, log pi(a_t | s_<t) for the last A tokens of each sequence:

    sequences (B, T) --model(position_ids from attention_mask)--> logits of positions T-A-1 .. T-2 (B, A, V)
        / temperature --log-softmax, gather sequences[:, -A:]--> log_probs (B, A)

where rows share a prompt (n samples per prompt) the model runs each distinct prompt once and only the response
columns per row, the same logits (workers/shared_prompt.py; checked per worker at init, --no_shared_prompt: off).

A vision-language model (image prompts, --max_images_per_prompt) takes the batch's image tensors with every forward
(batch.vision_inputs(): pixel_values etc. merged over the micro-batch's rows); its batches run the plain forward,
never the shared-prompt one (the prefix pass would need the images) nor packed (refused by validation).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional

import torch
from torch import nn

from orlhf.algo.logprobs import token_log_probs, token_log_probs_entropy, window
from orlhf.config.worker_config import WorkerConfig
from orlhf.distributed.endpoints import endpoint
from orlhf.types import SequenceBatch
from orlhf.workers.base import DeepSpeedWorker, position_ids_from
from orlhf.workers.batching import pack
from orlhf.workers.lm_head import chunked_head, head_log_probs, hidden_states_out
from orlhf.workers.loading import causal_lm_class, freeze_visual_encoder, from_pretrained
from orlhf.workers.router_replay import install, replay_of, routed
from orlhf.workers.shared_prompt import MIN_COMMON, shared_prompt_forward, worker_shares_prompts

log = logging.getLogger("orlhf.workers")


def load_causal_lm(cfg: WorkerConfig) -> nn.Module:
    """The model with its LM head (a vision-language model's through AutoModelForImageTextToText); with
    --freeze_visual_encoder only its language model and head left trainable."""
    model = from_pretrained(causal_lm_class(cfg), cfg.model_path, cfg)
    model.config.use_cache = False  # training and scoring never reuse a KV cache
    if cfg.freeze_visual_encoder:
        frozen = freeze_visual_encoder(model)
        log.info(
            "%s: --freeze_visual_encoder: %d parameter tensors frozen (vision tower, projector)", cfg.role, len(frozen)
        )
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

    shared: run each distinct prompt once for all rows that share it (workers/shared_prompt.py), when some do.
    Image prompts: the batch's image tensors go with the ids, always through the plain forward."""
    vision = batch.vision_inputs()  # {} for text prompts
    assert not (packed and vision), "--packing_samples with image prompts: validation refuses it"
    if packed:
        return _packed_action_logits(model, batch), 0
    num_actions = batch.num_actions
    keep = _accepts_logits_to_keep(model)
    position_ids = position_ids_from(batch.attention_mask)
    logits = shared_action_logits(model, batch, position_ids, keep) if shared and not vision else None
    if logits is not None:
        return logits, 0
    kwargs = dict(vision)
    if vision and _mrope(model):
        position_ids = None  # M-RoPE: the model computes its 3-D positions from the ids, the images and the mask
    if keep:  # the LM head then runs on A+1 positions only, not all T
        kwargs["logits_to_keep"] = num_actions + 1
    with routed(model, batch):  # --router_replay: the routers follow the batch's recorded experts
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

    def run(ids, mask, pos, cache, outputs: bool):  # the prompt passes need no logits: the LM head on one column
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **({"logits_to_keep": 1} if keep and not outputs else {}),
        )
        return out.logits, getattr(out, "past_key_values", None)

    if position_ids is None:
        position_ids = position_ids_from(batch.attention_mask)
    # --router_replay's passes take their routers' tokens by prompt columns: the common head's extra pass is left out
    common = 0 if replay_of(model) is not None else MIN_COMMON
    return shared_prompt_forward(
        run, batch, position_ids, around=lambda pick: routed(model, batch, pick), min_common=common
    )


def _packed_action_logits(model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    p = pack(batch)
    keep = _accepts_logits_to_keep(model)
    # attention_mask=None: transformers reads the sample boundaries from position_ids (varlen / block mask)
    with routed(model, batch, lambda x: x[batch.attention_mask.bool()]):  # pack's tokens: the real ones, in order
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
    chunked = chunked_action_log_probs(model, batch, temperature, packed, shared, chunk_mb, entropy=False)
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
    model: nn.Module,
    batch: SequenceBatch,
    temperature: float,
    packed: bool,
    shared: bool,
    chunk_mb: float,
    entropy: bool = True,
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
    return head_log_probs(head, hidden[:, offset : offset + a], batch.sequences[:, -a:], temperature, rows, entropy)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    module = getattr(model, "module", model)  # a DeepSpeedEngine forwards kwargs to its module
    if hasattr(module, "get_base_model"):  # a peft model passes unknown kwargs on to the transformers model
        module = module.get_base_model()
    return _forward_takes_logits_to_keep(type(module))


@functools.lru_cache(maxsize=None)
def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _mrope(model: nn.Module) -> bool:
    """Whether the model's rotary positions are multimodal (M-RoPE: Qwen2-VL and its successors, GLM-4V), which it
    derives itself from the ids, the image grids and the mask: a mrope_section in the text config's rope_scaling /
    rope_parameters, or a get_rope_index of its own (Qwen2-VL's modeling falls back to a default section without
    one). 1-D RoPE families (Idefics3's Llama) take the left-padding-aware positions given. Qwen2-VL does not load
    on the CPU install (no torchvision, docs/vlm.md), so this branch runs on GPU machines only."""
    hf = getattr(model, "module", model)  # a DeepSpeedEngine
    if any(hasattr(m, "get_rope_index") for m in (hf, getattr(hf, "model", None))):
        return True
    config = getattr(hf, "config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    ropes = [getattr(c, k, None) for c in (config, text) for k in ("rope_scaling", "rope_parameters")]
    return any(isinstance(rope, dict) and "mrope_section" in rope for rope in ropes)


def shares_prompts(worker: DeepSpeedWorker) -> bool:
    """Whether this causal-LM worker runs each distinct prompt once per forward (workers/shared_prompt.py)."""
    replay = replay_of(worker.engine) is not None  # its passes take no common head (shared_action_logits)
    return worker_shares_prompts(
        worker,
        lambda b: action_logits(worker.engine, b, 1.0),
        lambda b: shared_action_logits(worker.engine, b),
        kind=f"causal LM logits, router replay {replay}",
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
        if lora is not None:
            from orlhf.workers.lora import apply_lora

            model = apply_lora(model, lora)
        replay = getattr(self.cfg, "router_replay", None)  # the actor's --router_replay (workers/router_replay.py)
        return install(model, replay) if replay else model

    def _record_aux_loss(self, module: nn.Module, args, output) -> None:
        """Forward hook of the transformers model: its last forward's router load-balancing loss (a tensor in the
        graph), which the actor's loss adds (--aux_loss_coef)."""
        self.last_aux_loss = getattr(output, "aux_loss", None)

    @endpoint
    def init(self) -> None:
        """Collective: all ranks call it together. Shared-prompt forwards not with --aux_loss_coef: the router loss
        transformers computes needs whole rows in one forward (its padding mask does not fit a forward continued
        from a prompt's cache); nor for image prompts."""
        super().init()
        aux = getattr(getattr(self.cfg, "loss", None), "aux_loss_coef", 0.0) > 0
        # image prompts run the plain forward (model_logits), so a vision model is not checked for it
        self.shared_prompt = False if aux or self.cfg.vision else shares_prompts(self)

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
