"""The engines' slice of the config and the settings derived from it: dtype, log-prob mode, the environment an
engine actor sets before vLLM starts. No Ray, no vLLM: the driver, the planner and tests read these alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from orlhf.config.train_config import engine_gpu_memory_utilization


@dataclass(frozen=True)
class EngineConfig:
    """One engine's slice of the config."""

    model_path: str
    device: str  # "cpu" | "cuda"
    tensor_parallel_size: int = 1
    seed: int = 42
    full_determinism: bool = False  # --full_determinism: the engine core in this process, as OpenRLHF
    enforce_eager: bool = False
    enable_prefix_caching: bool = False
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 2048  # prompt_max_len + generate_max_len
    dtype: str = "float32"  # "bfloat16" with --bf16
    kv_cache_gb: Optional[float] = None  # CPU only: KV cache GiB; None: sized to the engine's need (CPU tuning)
    cpu_threads: int = 0  # CPU only: torch threads, --vllm_cpu_threads (0: as the CPU tuning shares the cores)
    enable_sleep: bool = False  # GPU only (--vllm_enable_sleep): vLLM's sleep mode, for hybrid placement
    cuda_ipc: bool = False  # GPU + --colocate_all_models: weights arrive as CUDA IPC handles (rollout/weight_sync.py)
    ray_sync: bool = False  # GPU + --vllm_sync_with_ray: the engine core in this process (engine_env)
    logprobs_mode: str = "raw_logprobs"  # vLLM's: what the sampled tokens' log-probs are (engine_logprobs_mode)
    max_images_per_prompt: int = 0  # > 0: a vision-language model's engine, taking this many images a prompt
    record_routing: bool = False  # --router_replay R3: each sampled sequence's routed experts (Rollout.routed_experts)
    share_prompts: bool = False  # CPU: a prompt's samples share its computed blocks (prefix caching, cpu/engine_kv.py)
    socket_ifname: Optional[str] = None  # --socket_ifname: the interface of its rendezvous (distributed/addresses.py)


def engine_config(cfg) -> EngineConfig:
    """The engines' slice of a finished TrainConfig (its device resolved: "cpu" or "cuda")."""
    v, device = cfg.vllm, cfg.device
    return EngineConfig(
        model_path=cfg.data.pretrain,
        device=device,
        tensor_parallel_size=v.tensor_parallel_size,
        seed=cfg.ppo.seed,
        full_determinism=cfg.deepspeed.full_determinism,
        enforce_eager=v.enforce_eager,
        enable_prefix_caching=v.enable_prefix_caching,
        gpu_memory_utilization=engine_gpu_memory_utilization(cfg),
        max_model_len=min(cfg.ppo.prompt_max_len + cfg.ppo.generate_max_len, cfg.ppo.max_len or 1 << 62),
        dtype=engine_dtype(cfg.deepspeed.bf16, device),
        kv_cache_gb=v.cpu_kv_cache_gb,
        cpu_threads=v.cpu_threads,
        enable_sleep=v.enable_sleep and device == "cuda",
        cuda_ipc=cfg.engines_colocated and device == "cuda",
        ray_sync=v.sync_with_ray and device == "cuda" and not cfg.engines_colocated,
        logprobs_mode=engine_logprobs_mode(cfg.ppo.temperature),
        max_images_per_prompt=cfg.data.max_images_per_prompt,
        record_routing=cfg.ppo.router_replay == "R3",
        share_prompts=device == "cpu" and cfg.ppo.router_replay != "R3",
        socket_ifname=cfg.runtime.socket_ifname,
    )


def engine_logprobs_mode(temperature: float) -> str:
    """The log-probs the engines report for sampled tokens. vLLM's default, raw_logprobs, is log_softmax(logits):
    at --temperature 1 exactly what the actor computes. At another temperature the actor scores log_softmax(logits
    / temperature) (workers/causal_lm.py), so the engines report processed_logprobs, the distribution they sample
    from after temperature, as OpenRLHF asks for its IS correction. (Processed also means after top-p: below
    --top_p 1 they are the truncated distribution's, which the actor does not compute, and the sync guard does not
    compare them; trainer/sync_guard.py. And after logits processors such as min_tokens, which orlhf's requests do
    not set; an agent's own sampling_params may.) Prompt log-probs are raw in both."""
    return "raw_logprobs" if temperature == 1.0 else "processed_logprobs"


def engine_dtype(bf16: bool, device: str) -> str:
    """The engines' dtype: the trainer's bfloat16 with --bf16; on GPUs bfloat16 also for a float32 trainer,
    because vLLM's GPU attention backends (FlashAttention, FlashInfer) take 16-bit only; synced float32
    weights are cast on receipt. On CPU the trainer's dtype, so engine and trainer log-probs match."""
    return "bfloat16" if bf16 or device == "cuda" else "float32"


def engine_env(cfg: EngineConfig, bundle_indices: Optional[Sequence[int]], share: float) -> dict[str, str]:
    """Environment an engine actor sets before it builds vLLM's LLM (vLLM reads these at start-up).

    - CPU, and --full_determinism on GPUs (as OpenRLHF): the engine core in this process
      (VLLM_ENABLE_V1_MULTIPROCESSING=0). So too with --vllm_sync_with_ray on GPUs: ray.util.collective runs only in
      Ray workers, which the engine-core subprocess is not (with TP 1 it holds the vLLM worker; with TP > 1 it
      starts the Ray executor's workers from a Ray connection of its own, where the group's named actors are not
      found).
    - CUDA IPC sync: collective_rpc arguments cross to the engine-core process through vLLM's msgpack encoder,
      which refuses the rebuild functions inside CUDA IPC handles unless VLLM_ALLOW_INSECURE_SERIALIZATION=1.
    - TP > 1 on GPUs: vLLM's Ray executor puts its TP workers on our bundles (VLLM_RAY_BUNDLE_INDICES), each
      asking Ray for VLLM_RAY_PER_WORKER_GPUS of a GPU (default 1.0). Colocated, the trainers hold the rest of
      each GPU, so a worker asks for the engine's share of its slot, else it would wait forever.
    """
    env: dict[str, str] = {}
    if cfg.device == "cpu" or cfg.full_determinism or cfg.ray_sync:  # --full_determinism: as OpenRLHF (vLLM's example)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg.device == "cpu":
        return env
    if cfg.cuda_ipc:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if cfg.tensor_parallel_size > 1 and bundle_indices is not None:
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, bundle_indices))
        env["VLLM_RAY_PER_WORKER_GPUS"] = repr(float(share))
    return env
