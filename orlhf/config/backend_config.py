"""The flag groups of how the models run: the vLLM engines (or generation in the actor's ranks) and DeepSpeed. Part of
TrainConfig (config/train_config.py), declared as its other groups are (config/option.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.config.option import opt
from orlhf.config.rollout_backends import BACKENDS, DEFAULT_BACKEND

SYNC_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class VLLMConfig:
    num_engines: int = opt(
        1,
        "Number of vLLM rollout engines; 0: the actor's ranks generate (--rollout_backend trainer).",
        flag="vllm_num_engines",
    )
    rollout_backend: str = opt(
        DEFAULT_BACKEND,
        "Who generates the rollouts: vllm (engines of their own, weights synced after every update) or trainer (the "
        "actor's ranks, with transformers' generate on their own weights: no vLLM, no weight sync; for models or "
        "machines vLLM does not support, and debugging). --vllm_num_engines 0 means trainer.",
        choices=tuple(BACKENDS),
    )
    tensor_parallel_size: int = opt(1, "GPUs per vLLM engine (tensor parallel).", flag="vllm_tensor_parallel_size")
    sync_backend: Optional[str] = opt(
        None,
        "Weight-sync backend trainer -> engines (default: nccl on GPUs, gloo on CPU).",
        flag="vllm_sync_backend",
        choices=SYNC_BACKENDS,
    )
    sync_with_ray: bool = opt(
        False,
        "Weight sync through Ray's collective library (ray.util.collective: NCCL via cupy on GPUs, gloo on CPU) "
        "instead of a torch/vLLM process group, as OpenRLHF's flag. No effect under --colocate_all_models on GPUs, "
        "where CUDA IPC moves the weights.",
        flag="vllm_sync_with_ray",
    )
    sync_delta: bool = opt(
        False,
        "Weight sync sends only the elements whose engine-dtype value changed since the last sync (after a full first "
        "one); the engines end bit for bit where a full sync leaves them. Pays with 16-bit engines at RL learning "
        "rates, where few bf16 values move per update; costs one engine-dtype copy of the synced weights on actor "
        "rank 0 and in every engine worker (docs/weight_sync_delta.md).",
        flag="vllm_sync_delta",
    )
    gpu_memory_utilization: Optional[float] = opt(
        None,
        "Share of each engine GPU's memory vLLM may take (default: 0.9 on the engines' own GPUs, 0.5 under "
        "--colocate_all_models, where the trainers share them).",
        flag="vllm_gpu_memory_utilization",
    )
    enable_prefix_caching: bool = opt(
        False,
        "vLLM prefix caching (reset after every weight sync). CPU engines of plain-attention models have it on "
        "anyway, so that a prompt's samples share its computed blocks (not with --router_replay R3).",
    )
    enforce_eager: bool = opt(False, "Run vLLM without CUDA graphs / torch.compile (faster start-up).")
    enable_sleep: bool = opt(
        False,
        "Sleep vLLM (free weights and KV cache) while training; needs --colocate_all_models.",
        flag="vllm_enable_sleep",
    )
    cpu_kv_cache_gb: Optional[float] = opt(
        None,
        "CPU only: KV cache per engine in GiB (default: what 256 sequences of --prompt_max_len + "
        "--generate_max_len tokens need, at most 1 GiB).",
        flag="vllm_cpu_kv_cache_gb",
    )
    cpu_threads: int = opt(
        0,
        "CPU only: torch threads per engine (0: the cores // engines in sync mode, where the engines generate "
        "alone; one per CPU slot with --async_train).",
        flag="vllm_cpu_threads",
    )
    sync_bucket_mb: float = opt(
        256.0, "Weight-sync bucket size in MiB (whole layers per bucket).", flag="vllm_sync_bucket_mb"
    )
    max_engine_logprob_gap: Optional[float] = opt(
        None,
        "Stop the run when the engines' log-probs of the sampled tokens differ from the actor's by more than this "
        "per token (a broken weight sync). Default: calibrated on the run's own gap at step 1, before any sync "
        "(4x it + 1e-4; past 1e-3, or 0.2 with bf16 engines, the run stops there); 0 or negative: off.",
        flag="max_engine_logprob_gap",
    )
    max_engine_restarts: int = opt(
        3,
        "vLLM engines that die or miss the --ray_timeout_s deadline of a generate, replaced in place over the whole "
        "run (a new engine on the same GPUs, loaded with the current weights; the lost part of the batch generated "
        "again with the same seeds) before the run stops naming the engine. 0: stop at the first.",
    )


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: Optional[int] = opt(
        None,
        "DeepSpeed ZeRO stage of every model. Default: 3; a one-rank group, with nothing to partition, trains and "
        "scores without ZeRO (3 with --deepspeed_enable_sleep, or --ref_reward_offload on GPUs; a trained one 2 with "
        "--bf16, --adam_offload, Muon or --grad_accum_dtype other than fp32).",
        choices=(0, 1, 2, 3),
    )
    bf16: bool = opt(False, "Train and score in bfloat16 (fp32 master weights kept by DeepSpeed).")
    allow_slow_bf16: bool = opt(
        False,
        "With --bf16 on --device cpu: train in bf16 even on a CPU without bf16 instructions (avx512_bf16, amx_bf16), "
        "where torch emulates it many times slower than fp32 and the run is refused otherwise.",
    )
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass to save memory.")
    adam_offload: bool = opt(False, "Keep Adam states on the host (ZeRO-Offload).")
    ref_reward_offload: bool = opt(False, "Keep reference/reward parameters on the host between uses.")
    flash_attn: bool = opt(False, "Use flash-attention 2 kernels (CUDA only).")
    eager_attention: bool = opt(
        False, "Use transformers' eager attention instead of SDPA (OpenRLHF's --attn_implementation eager)."
    )
    enable_sleep: bool = opt(
        False, "Offload DeepSpeed states during generation (hybrid mode).", flag="deepspeed_enable_sleep"
    )
    experts_implementation: Optional[str] = opt(
        None,
        "MoE models: how transformers computes the experts (default: transformers' choice).",
        choices=("eager", "batched_mm", "grouped_mm", "deepgemm"),
    )
    packing_samples: bool = opt(
        False,
        "Pack each micro-batch's samples into one row without padding (flash-attn varlen on GPUs; a "
        "block-diagonal mask under SDPA).",
    )
    logprobs_chunk_mb: float = opt(
        256.0,
        "Log-probs and entropy from the LM head a chunk of tokens at a time, each chunk's float32 logits about this "
        "many MiB, where a micro-batch's whole logits would be larger (long responses, large vocabularies); 0: "
        "always the whole logits.",
    )
    train_cpu_threads: int = opt(
        0,
        "CPU only: torch threads per model rank (0: handed over per phase: the cores shared among the ranks "
        "that work in it, e.g. all to the actor while it trains alone; sync mode).",
    )
    no_trim_padding: bool = opt(
        False,
        "Keep training/scoring micro-batches padded to the whole batch's longest sequence (turns off "
        "padding removal; for benchmarks).",
    )
    no_shared_prompt: bool = opt(
        False,
        "Run every sample's prompt in its own row (turns off running each distinct prompt once per "
        "micro-batch for all its samples in the actor's and reference's forwards; for benchmarks and checks).",
    )
    use_dynamic_batch: bool = opt(
        False,
        "Micro-batches by a budget of real tokens (prompt + response) instead of a sample count: training by "
        "--train_max_tokens_per_gpu, scoring forwards by --rollout_max_tokens_per_gpu.",
    )
    train_max_tokens_per_gpu: int = opt(
        16192,
        "With --use_dynamic_batch: most real tokens in one training micro-batch per rank (a longer "
        "sample gets a micro-batch of its own).",
    )
    rollout_max_tokens_per_gpu: Optional[int] = opt(
        None,
        "With --use_dynamic_batch: most real tokens in one scoring forward per rank (default: "
        "--train_max_tokens_per_gpu).",
    )
    gradient_checkpointing_use_reentrant: bool = opt(
        False, "With --gradient_checkpointing: torch's reentrant activation checkpointing (default: non-reentrant)."
    )
    overlap_comm: bool = opt(
        False,
        "Trained models: overlap the gradient reduction with the backward pass, in contiguous gradient buffers "
        "(DeepSpeed's zero_optimization.overlap_comm; ZeRO-3 overlaps already, this turns it on for ZeRO-1/2).",
    )
    grad_accum_dtype: Optional[str] = opt(
        None,
        "Trained models: the dtype DeepSpeed accumulates gradients in (data_types.grad_accum_dtype; default: the "
        "model's, fp32 or bf16 with --bf16). Under ZeRO-0 only the model's own dtype.",
        choices=("fp32", "bf16", "fp16"),
    )
    zpg: int = opt(
        1,
        "ZeRO++ hierarchical partitioning: trained models under ZeRO-3 also keep their weights partitioned within "
        "groups of this many ranks, gathered there in the forward and backward (zero_hpz_partition_size; a group "
        "larger than the model's ranks is all of them; 1: off).",
    )
    full_determinism: bool = opt(
        False,
        "Deterministic kernels in every model rank: torch.use_deterministic_algorithms, cuDNN deterministic "
        "without autotuning, cuBLAS's fixed workspace and flash-attention's deterministic backward (slower).",
    )
    use_liger_kernel: bool = opt(
        False,
        "Liger's Triton kernels in the actor and the reference (AutoLigerKernelForCausalLM; CUDA only, "
        "pip install liger-kernel).",
    )
