"""A CPU engine's vLLM import without torch's compiler (cpu/vllm_import.py), each in a fresh process: vLLM's own
import loads torch._inductor's compiler; the trimmed one loads none of it, and vLLM's inductor patch is in place
once inductor's lowering is imported after all."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

COMPILER = ("torch._inductor.lowering", "torch._inductor.compile_fx", "torch._inductor.select_algorithm")

PROBE = r"""
import json, sys
import torch
from orlhf.cpu.vllm_import import import_vllm
trimmed = import_vllm() if sys.argv[1] == "trimmed" else bool(__import__("vllm.entrypoints.llm"))
from vllm import LLM  # noqa: F401
loaded = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
import torch._inductor.lowering as lowering
print(json.dumps({"trimmed": trimmed, "loaded": loaded,
                  "allow_list": type(lowering.FALLBACK_ALLOW_LIST).__name__,
                  "deferred": torch.compile.__name__ == "deferred_compile"}))
"""


def probe(how: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, how, json.dumps(COMPILER)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_imports_without_torchs_compiler_and_keeps_its_inductor_patch():
    own = probe("own")
    assert own["loaded"] == list(COMPILER)  # vLLM's own import loads the compiler (what the trim is for)
    assert own["allow_list"] == "_VllmFallbackAllowList" and not own["deferred"]

    trimmed = probe("trimmed")
    assert trimmed["trimmed"], "the pinned vLLM should get the trimmed import"
    assert trimmed["loaded"] == []
    assert trimmed["allow_list"] == "_VllmFallbackAllowList"  # applied when lowering was imported after all
    assert trimmed["deferred"]
