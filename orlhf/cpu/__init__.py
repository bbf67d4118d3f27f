"""What exists only for CPU runs, reached through one seam (distributed/tuning.py: CpuTuning in cpu/tuning.py):
hosting frozen models in the actor's rank processes, per-phase thread hand-over, vLLM-CPU sampler and KV sizing,
start-up import patches, the Ray worker preload. Never imported on CUDA."""
