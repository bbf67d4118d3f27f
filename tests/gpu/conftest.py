"""Fixtures for the one-GPU tests: a tiny local Llama and a world-size-1 process group.

The workers are plain classes, so these tests need torch, transformers and DeepSpeed only: no Ray, no vLLM
(scripts/gpu_check.sh runs them on a bare CUDA machine). DeepSpeed picks its accelerator once per process from
DS_ACCELERATOR, which the root conftest defaults to "cpu": the GPU tests need it set to "cuda" before pytest
starts (gpu_check.sh does), and fail saying so when it is not.
"""

import os
import socket

import pytest
from gpu_helpers import tiny_llama


@pytest.fixture(scope="session")
def lm_path(tmp_path_factory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("gpu") / "lm")


@pytest.fixture(scope="session")
def dist_env():
    """World size 1 on cuda:0 for DeepSpeed workers (each worker's init() joins it once per process)."""
    if os.environ.get("DS_ACCELERATOR") != "cuda":
        pytest.fail(
            "DeepSpeed GPU tests need DS_ACCELERATOR=cuda before pytest starts (scripts/gpu_check.sh sets "
            f"it); got {os.environ.get('DS_ACCELERATOR')!r}"
        )
    pytest.importorskip("deepspeed", reason="needs DeepSpeed (scripts/gpu_check.sh installs a carried wheel)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    yield
