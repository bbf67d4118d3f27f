"""The actor of a DeepSpeed-Chat-style hybrid engine: orlhf's PolicyWorker that also generates, with HF `generate`,
from its own ZeRO-3 engine (no vLLM, no weight sync). Used by hybrid_engine_baseline.py (this folder); benchmark
code, not part of the orlhf package. It takes orlhf's SamplingSpec, as the vLLM engines do.

    prompts (this rank's share) --left-pad--> (b, P) --module.generate(do_sample, n per prompt)--> (b*n, P+L)
        --cut at the prompt's token limit, then after the first EOS, per row--> [Rollout] (response ids, the
        sampler's log-probs, finished)

How the parameters reach `generate` (`gather`):
    whole       GatheredParameters over the whole model for the whole generate call, as DeepSpeed's hybrid
                engine does with pin_parameters=True; ranks generate independently (no collectives inside).
                ZeRO-3's per-module hooks are removed for the call and registered again after it (hook_free,
                the default): the hybrid engine's inference containers run outside them too, and with them
                every decode step pays their bookkeeping on every layer.
                hook_free=False keeps the hooks and marks the parameters external instead, so the hooks leave
                them gathered (they would otherwise release each layer after its forward).
    per_layer   no gather: ZeRO-3's hooks fetch each layer on every decode step (DeepSpeed-Chat without the
                hybrid engine); collective, so ranks run in lockstep (synced_gpus) until all are done.
    hybrid_engine=True  DeepSpeed's own DeepSpeedHybridEngine ("hybrid_engine": {"enabled": true}) and its
                `engine.generate` (inference kernels; CUDA only in practice).

Invariants: every rank calls generate() once per step (the collectives of per_layer / hybrid_engine need equal
call counts). Sampling is vLLM's default: top_k off (HF's generation_config would apply top_k=50), temperature and
top_p as given, stopping at EOS or at each prompt's own token limit (orlhf.types.max_new_tokens: --generate_max_len,
and with --max_len what is left after the prompt; the batch generates to the largest limit, each row is cut to its
own). The log-probs are those of the distribution sampled from (logits / temperature, top-p applied; recorded step
by step, not kept as HF's (B, L, V) output_scores), so with top_p=1 they match PolicyWorker.log_probs up to float
error.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional

import torch

from orlhf.config.worker_config import WorkerConfig
from orlhf.types import Rollout, SamplingSpec, max_new_tokens
from orlhf.workers.policy import PolicyWorker

GATHER_MODES = ("whole", "per_layer")


class HybridPolicyWorker(PolicyWorker):
    """PolicyWorker + generate(). Everything else (log_probs, train_step) is the orlhf actor's, unchanged."""

    def __init__(
        self, cfg: WorkerConfig, gather: str = "whole", hybrid_engine: bool = False, max_out_tokens: int = 512
    ):
        if gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
        super().__init__(cfg)
        self.gather, self.hybrid_engine, self.max_out_tokens = gather, hybrid_engine, max_out_tokens
        self.hook_free = True  # whole: generate with ZeRO-3's module hooks removed (False: marked external)

    def deepspeed_config(self) -> dict:
        """orlhf's actor config; with hybrid_engine plus its section, so that deepspeed.initialize (in orlhf's
        DeepSpeedWorker.init, unchanged) returns a DeepSpeedHybridEngine: the same training path, plus generate()
        on injected inference kernels."""
        config = super().deepspeed_config()
        if not self.hybrid_engine:
            return config
        return {
            **config,
            "hybrid_engine": {
                "enabled": True,
                "max_out_tokens": self.max_out_tokens,
                "inference_tp_size": 1,
                "release_inference_cache": False,
                "pin_parameters": True,
                "tp_gather_partition_size": 8,
            },
        }

    @torch.no_grad()
    def generate(
        self, prompts: list[tuple[int, list[int]]], spec: SamplingSpec, pad_id: int, eos_id: int
    ) -> list[Rollout]:
        """prompts: (prompt_index, token ids). Returns spec.n rollouts per prompt, in the given order."""
        from transformers import GenerationConfig

        if not prompts:
            raise ValueError("generate() needs at least one prompt on every rank (collective under ZeRO-3)")
        P = max(len(ids) for _, ids in prompts)
        input_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
        attention_mask = torch.zeros(len(prompts), P, dtype=torch.long)
        for i, (_, ids) in enumerate(prompts):  # left-padded: every prompt ends where generation starts
            input_ids[i, P - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, P - len(ids) :] = 1
        # Temperature and top-p are ours (HF adds no warpers at 1.0), so the recorder sees the final distribution.
        gen = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max(max_new_tokens(spec, len(ids)) for _, ids in prompts),
            num_return_sequences=spec.n,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            use_cache=True,
        )
        recorder = SampledLogProbs()
        torch.manual_seed(spec.seed * 1009 + self.rank)
        self.engine.eval()
        kwargs = dict(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=gen,
            logits_processor=sampling_processors(spec, recorder),
        )
        if self.hybrid_engine:
            out = self.engine.generate(**kwargs)
        elif self.gather == "per_layer":
            out = self.module.generate(**kwargs, synced_gpus=self.zero3 and self.world_size > 1)
        else:
            with self._whole_model_gathered():
                out = self.module.generate(**kwargs)
        sequences = out.cpu()  # (b*n, P+L): rows of one prompt are adjacent (num_return_sequences)
        return to_rollouts(prompts, sequences, recorder.finish(sequences.to(self.device)).cpu(), P, spec, eos_id)

    @contextmanager
    def _whole_model_gathered(self):
        """All parameters gathered, and kept gathered through every forward of the block (see the docstring)."""
        if not self.zero3:
            yield
            return
        import deepspeed

        params = list(self.module.parameters())
        offload = getattr(self.engine.optimizer, "parameter_offload", None)
        with deepspeed.zero.GatheredParameters(params):
            if self.hook_free and offload is not None:
                with _zero3_hooks_removed(offload):
                    yield
                return
            was_external = [p.is_external_param for p in params]
            for p in params:
                p.is_external_param = True
            try:
                yield
            finally:
                for p, w in zip(params, was_external):
                    p.is_external_param = w


@contextmanager
def _zero3_hooks_removed(offload):
    """ZeRO-3's per-module hooks off for the block, as DeepSpeed's hybrid engine generates outside them: with them
    every decode step pays their bookkeeping (fetch checks, trace, prefetch) on every layer. Registering them
    again also pushes the root module on DeepSpeed's module stack; that entry is dropped so the stack (which
    its hooks scan on every forward) does not grow by one per step."""
    from deepspeed.runtime.zero import parameter_offload

    depth = len(parameter_offload.FWD_MODULE_STACK)
    offload._remove_module_hooks()
    try:
        yield
    finally:
        offload.forward_hooks, offload.backward_hooks = [], []
        offload.setup_zero_stage3_hooks()
        del parameter_offload.FWD_MODULE_STACK[depth:]


def sampling_processors(spec: SamplingSpec, recorder: "SampledLogProbs"):
    """vLLM's order: temperature, then top-p; the recorder last, on the distribution actually sampled from."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    procs = [TemperatureLogitsWarper(spec.temperature)] if spec.temperature != 1.0 else []
    procs += [TopPLogitsWarper(spec.top_p)] if spec.top_p < 1.0 else []
    return LogitsProcessorList([*procs, recorder])


class SampledLogProbs:
    """A logits processor that records log p(sampled token), holding one step's log-softmax (B, V) instead of
    HF's output_scores (B, L, V): at step t it reads the token chosen at t-1 from input_ids."""

    def __init__(self):
        self.prev: Optional[torch.Tensor] = None  # (B, V) log-softmax of the last processed step
        self.steps: list[torch.Tensor] = []  # (B,) per generated token but the last

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = scores.float().log_softmax(-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, L) log-probs of the L generated tokens (the last one read from the final sequences)."""
        steps = list(self.steps)
        if self.prev is not None:
            steps.append(self.prev.gather(-1, sequences[:, -1:]).squeeze(-1))
        return torch.stack(steps, 1) if steps else torch.zeros(sequences.shape[0], 0)


def to_rollouts(
    prompts: list[tuple[int, list[int]]],
    sequences: torch.Tensor,
    logprobs: torch.Tensor,
    P: int,
    spec: SamplingSpec,
    eos_id: int,
) -> list[Rollout]:
    """(b*n, P+L) sequences and (b*n, L) log-probs -> Rollouts cut at the prompt's token limit, then after the
    first EOS (padding dropped)."""
    rollouts = []
    for row in range(sequences.shape[0]):
        index, ids = prompts[row // spec.n]
        response = sequences[row, P : P + max_new_tokens(spec, len(ids))].tolist()
        finished = eos_id in response
        keep = response.index(eos_id) + 1 if finished else len(response)
        lps = [lp if math.isfinite(lp) else 0.0 for lp in logprobs[row, :keep].tolist()]
        rollouts.append(
            Rollout(
                prompt_index=index, prompt_ids=list(ids), response_ids=response[:keep], logprobs=lps, finished=finished
            )
        )
    return rollouts
