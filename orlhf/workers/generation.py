"""Generation inside the actor's ranks (--rollout_backend trainer): transformers' generate on the rank's own weights,
sampling as the vLLM engines do. PolicyWorker.generate / generate_tokens call in here.

    requests (this rank's share: prompt ids, seed, token limit) --left-pad--> (b, P)
        --generate, one token a step--> logits --temperature, top-p--> RowSampler --> (b, P+L)
        RowSampler: row i draws its token with its own seeded stream, records log p(token), forces it
        --cut at the row's token limit, then after the first EOS--> (response ids, log-probs, finished)

Sampling is vLLM's default, as SamplingSpec describes it: no top-k, temperature and top-p as given, stop at any of the
model's EOS ids or at the request's token limit (the batch generates to the largest limit; each row is cut to its
own). Every row draws from a counter-based stream of its own seed (request_seed(step seed, prompt index) and the
sample's number; an agent's turn seed), so a sample depends neither on how prompts are split over ranks or batched
nor on the device: a seeded run is reproducible, and resumes as an uninterrupted one. The recorded log-probs are of
the distribution sampled from (logits / temperature, after top-p): vLLM's processed log-probs, equal to the raw ones
at temperature 1 and top-p 1, where the sync guard compares them with the training forward's.

The model's own generation_config (a checkpoint's temperature, top_k, ...) is set aside for the call: the flags
say how to sample, as they do for vLLM engines.

ZeRO-3: the whole model is gathered for the call (GatheredParameters) with DeepSpeed's per-module hooks off meanwhile
(with them every decode step pays their bookkeeping on every layer), as DeepSpeed's hybrid engine generates. The
gather is collective: every rank calls, with or without requests of its own.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from orlhf.types import Rollout, SamplingSpec, max_new_tokens, request_seed


@dataclass(frozen=True)
class Request:
    """One sequence to continue: its prompt ids, its sampling stream's seed and its new-token limit."""

    ids: list[int]
    seed: int
    limit: int


@dataclass(frozen=True)
class Sampled:
    ids: list[int]  # response ids, cut at the limit and after the first EOS
    logprobs: list[float]  # of the sampled distribution, one per id
    finished: bool  # ended on an EOS id (vLLM's finish_reason "stop")


def rollouts(worker, prompts: list[tuple[int, list[int]]], spec: SamplingSpec, pad_id: int, eos_id: int, **how):
    """prompts: (prompt index, ids) -> spec.n Rollouts per prompt, in order (engine 0, weight version set by the
    driver). `how`: sample()'s generate / gather."""
    requests = [
        Request(list(ids), sample_seed(request_seed(spec.seed, index), k), max_new_tokens(spec, len(ids)))
        for index, ids in prompts
        for k in range(spec.n)
    ]
    out = sample(worker, requests, spec.temperature, spec.top_p, pad_id, eos_id, **how)
    return [
        Rollout(prompt_index=index, prompt_ids=list(ids), response_ids=s.ids, logprobs=s.logprobs, finished=s.finished)
        for (index, ids), s in zip([p for p in prompts for _ in range(spec.n)], out)
    ]


def turns(worker, requests: list[tuple[list[int], Any]], pad_id: int, eos_id: int) -> list[tuple]:
    """Agents' turns: (ids, vLLM-style SamplingParams) -> (new ids, log-probs, finish reason), one batch per
    distinct (temperature, top_p), in the given order."""
    groups: dict[tuple[float, float], list[int]] = {}
    for j, (_, p) in enumerate(requests):
        check_turn_params(p)
        groups.setdefault((float(p.temperature), float(p.top_p)), []).append(j)
    results: list[Optional[tuple]] = [None] * len(requests)
    for (temperature, top_p), rows in sorted(groups.items()):
        batch = [Request(list(requests[j][0]), int(requests[j][1].seed), int(requests[j][1].max_tokens)) for j in rows]
        extra = sorted({t for j in rows for t in (requests[j][1].stop_token_ids or [])})
        for j, s in zip(rows, sample(worker, batch, temperature, top_p, pad_id, eos_id, extra)):
            results[j] = (s.ids, s.logprobs, "stop" if s.finished else "length")
    return results


def check_turn_params(p) -> None:
    """What the trainer's sampler honours of an agent's SamplingParams; ValueError naming the rest."""
    if getattr(p, "stop", None):
        raise ValueError(
            f"sampling_params.stop = {p.stop!r}: stop strings need vLLM engines; with --rollout_backend trainer "
            "stop on token ids (sampling_params.stop_token_ids)"
        )
    for name, off in (("top_k", (0, -1, None)), ("min_p", (0.0, None)), ("min_tokens", (0, None))):
        if getattr(p, name, None) not in off:
            raise ValueError(
                f"sampling_params.{name} = {getattr(p, name)!r} needs vLLM engines (--rollout_backend vllm)"
            )
    if p.seed is None or p.max_tokens is None:
        raise ValueError("sampling_params needs a seed and max_tokens (the agent runner sets both)")


def sample_seed(seed: int, k: int) -> int:
    """Sample k's stream of a request seeded `seed` (vLLM draws a request's n samples from one seed)."""
    return (seed * 1_000_003 + k) % (1 << 63)


@torch.no_grad()
def sample(
    worker,
    requests: Sequence[Request],
    temperature: float,
    top_p: float,
    pad_id: int,
    eos_id: Optional[int],
    extra_eos: Sequence[int] = (),
    generate: Optional[Callable[..., torch.Tensor]] = None,
    gather: bool = True,
) -> list[Sampled]:
    """Generate every request on `worker`'s model (a DeepSpeedWorker: .engine, .module, .device, .zero3).
    `generate(**kwargs)`: the model's generate unless given; `gather`: False leaves ZeRO-3's hooks to fetch each
    layer (the DeepSpeed-Chat-style baseline in benchmarks/ compares both)."""
    from transformers import GenerationConfig

    model = worker.module
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model
    eos = eos_ids(hf, eos_id, extra_eos)
    was_training = worker.engine.training
    worker.engine.eval()
    try:
        with whole_model_gathered(worker) if gather else nullcontext(), own_generation_config(hf):
            if not requests:
                return []
            P = max(len(r.ids) for r in requests)
            input_ids = torch.full((len(requests), P), pad_id, dtype=torch.long)
            attention_mask = torch.zeros(len(requests), P, dtype=torch.long)
            for i, r in enumerate(requests):  # left-padded: every prompt ends where generation starts
                input_ids[i, P - len(r.ids) :] = torch.tensor(r.ids, dtype=torch.long)
                attention_mask[i, P - len(r.ids) :] = 1
            sampler = RowSampler([r.seed for r in requests], worker.device)
            gen = GenerationConfig(
                do_sample=False,  # the sampler has drawn each row's token already and left it the only choice
                max_new_tokens=max(r.limit for r in requests),
                eos_token_id=eos,
                pad_token_id=pad_id,
                use_cache=True,
            )
            out = (generate or model.generate)(
                input_ids=input_ids.to(worker.device),
                attention_mask=attention_mask.to(worker.device),
                generation_config=gen,
                logits_processor=sampling_processors(temperature, top_p, sampler),
            )
            sequences = out[:, P:].cpu()  # (b, L)
            logprobs = sampler.logprobs(sequences.shape[1]).cpu()  # (b, L)
    finally:
        worker.engine.train(was_training)
    return [cut(sequences[i].tolist(), logprobs[i].tolist(), r.limit, eos) for i, r in enumerate(requests)]


def eos_ids(hf_model, eos_id: Optional[int], extra: Sequence[int] = ()) -> list[int]:
    """Where a response ends: the tokenizer's EOS and the model's generation_config EOS ids (vLLM stops at both),
    plus a turn's stop_token_ids."""
    ids = {eos_id} if eos_id is not None else set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        e = getattr(source, "eos_token_id", None)
        ids.update(e if isinstance(e, (list, tuple)) else [e] if e is not None else [])
    return sorted(ids | set(extra))


def cut(response: list[int], logprobs: list[float], limit: int, eos: list[int]) -> Sampled:
    """The row's first `limit` tokens, ending after the first EOS id (generate pads finished rows)."""
    response, logprobs = response[:limit], logprobs[:limit]
    end = next((i for i, t in enumerate(response) if t in eos), None)
    keep = len(response) if end is None else end + 1
    lps = [lp if math.isfinite(lp) else 0.0 for lp in logprobs[:keep]]
    return Sampled(response[:keep], lps, end is not None)


def sampling_processors(temperature: float, top_p: float, sampler: "RowSampler"):
    """vLLM's order: temperature, then top-p; the sampler last, on the distribution actually sampled from."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    procs = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    procs += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    return LogitsProcessorList([*procs, sampler])


MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bit patterns (int64 arithmetic wraps as uint64 would)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """(B,) float64 in [0, 1): draw `step` of each row's counter-based stream (splitmix64 of the row's seed, then
    of the step), the same on every device."""
    key = _mix(seeds * _GOLDEN + _GOLDEN)
    z = _mix(key + _signed(((step + 1) * 0x9E3779B97F4A7C15) & MASK64))
    return _shr(z, 11).to(torch.float64) * 2.0**-53


class RowSampler:
    """A logits processor that samples: row i draws inverse-CDF from its own stream (uniforms), records log p of
    the drawn token under the scores it was given, and returns scores that leave that token the only choice."""

    def __init__(self, seeds: list[int], device):
        self.seeds = torch.tensor([s % (1 << 63) for s in seeds], dtype=torch.long, device=device)
        self.steps: list[torch.Tensor] = []  # (B,) log-probs per generated position

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = scores.float().log_softmax(-1)  # (B, V)
        cdf = logp.exp().double().cumsum(-1)
        u = uniforms(self.seeds, len(self.steps)).to(cdf.device) * cdf[:, -1]
        token = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=scores.shape[-1] - 1)  # (B, 1)
        self.steps.append(logp.gather(-1, token).squeeze(-1))
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, token, 0.0)

    def logprobs(self, length: int) -> torch.Tensor:
        """(B, length) recorded log-probs (generate may stop before the processor's last call is used)."""
        if not self.steps:
            return torch.zeros(len(self.seeds), length)
        return torch.stack(self.steps, 1)[:, :length]


@contextmanager
def own_generation_config(hf_model):
    """The model's generation_config set aside for the call (transformers fills a passed config's unset fields
    from it: a checkpoint's temperature or top_k would otherwise sample on top of the flags)."""
    from transformers import GenerationConfig

    saved = getattr(hf_model, "generation_config", None)
    hf_model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = saved


def whole_model_gathered(worker):
    """ZeRO-3: all parameters gathered for the block, ZeRO-3's module hooks removed meanwhile (see the docstring)."""
    if not worker.zero3:
        return nullcontext()
    return _gathered(worker)


@contextmanager
def _gathered(worker):
    import deepspeed

    params = list(worker.module.parameters())
    offload = getattr(worker.engine.optimizer, "parameter_offload", None)
    with deepspeed.zero.GatheredParameters(params):
        if offload is None:
            yield
            return
        with _zero3_hooks_removed(offload):
            yield


@contextmanager
def _zero3_hooks_removed(offload):
    """Registering the hooks again also pushes the root module on DeepSpeed's module stack; that entry is dropped
    so the stack (which its hooks scan on every forward) does not grow by one per generation."""
    from deepspeed.runtime.zero import parameter_offload

    depth = len(parameter_offload.FWD_MODULE_STACK)
    offload._remove_module_hooks()
    try:
        yield
    finally:
        offload.forward_hooks, offload.backward_hooks = [], []
        offload.setup_zero_stage3_hooks()
        del parameter_offload.FWD_MODULE_STACK[depth:]
