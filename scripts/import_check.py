"""The install's last step: import the stack once (a broken install fails here, loudly, not in a run's first minute),
and fill vLLM's model-info cache for the architectures the demos use.

Why the cache: before an engine loads a model, vLLM inspects its architecture's class in a subprocess of its own
(vllm/model_executor/models/registry.py, "performed in another process to avoid initializing CUDA"), which imports
torch and vLLM again: the longest part of a first engine start on a small CPU. It keeps the answer in
$VLLM_CACHE_ROOT/modelinfos (default ${XDG_CACHE_HOME:-~/.cache}/vllm), keyed by the model file's hash, and reads
it on every later start. This process has vLLM imported already, so it writes that entry for a fraction of the cost.
The cache is an optimisation: if vLLM's private registry API moves, this says so and the install goes on.

    python scripts/import_check.py     # scripts/install.sh runs it after the byte-compile
    ORLHF_INSTALL_DEMO=1 python scripts/import_check.py   # also build the tiny demo into the user's cache
                                                          # (scripts/quickstart.sh: its run then starts from it)

vLLM's half (its import and the cache) runs in a child process beside the rest, one core each. The demo: this
process has torch and transformers imported already, which a run's driver would otherwise import just to build it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# The built-in demo and `make-demo --real` (SmolLM2) are Llamas.
DEMO_ARCHITECTURES = ("LlamaForCausalLM",)


def warm_vllm_model_info(architectures: tuple[str, ...] = DEMO_ARCHITECTURES) -> list[str]:
    """Write vLLM's cached model info for each architecture in this process; the names written."""
    from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo

    written = []
    for arch in architectures:
        model = ModelRegistry.models[arch]
        spec = importlib.util.find_spec(model.module_name)
        if spec is None or spec.origin is None:
            continue
        module_hash = model._get_modelinfo_module_hash(Path(spec.origin))
        if model._load_modelinfo_from_cache(module_hash) is not None:
            continue
        model._save_modelinfo_to_cache(_ModelInfo.from_model_cls(model.load_model_cls()), module_hash)
        written.append(arch)
    return written


def vllm_half() -> int:
    try:
        written = warm_vllm_model_info()
    except Exception as e:  # an optimisation only: the engine inspects the class itself then
        print(
            f"[install] vLLM's model-info cache not filled ({type(e).__name__}: {e}); engines fill it on first start",
            file=sys.stderr,
        )
        return 0
    if written:
        print(f"[install] vLLM's model-info cache: {', '.join(written)}", file=sys.stderr)
    return 0


def main() -> None:
    vllm = None
    if importlib.util.find_spec("vllm") is not None:
        vllm = subprocess.Popen([sys.executable, __file__, "--vllm"])
    import deepspeed
    import ray
    import torch
    import transformers

    print(
        f"[install] torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}, "
        f"deepspeed {deepspeed.__version__}",
        file=sys.stderr,
    )
    if os.environ.get("ORLHF_INSTALL_DEMO") == "1":
        from orlhf.demo.builder import ensure_demo

        print(f"[install] the tiny demo: {ensure_demo().root}", file=sys.stderr)
    if vllm is not None and vllm.wait() != 0:  # `import vllm` itself failed: a broken install
        sys.exit(f"[install] importing vLLM failed (exit {vllm.returncode}): see the lines above")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--vllm"]:
        import vllm  # noqa: F401  (a broken vLLM fails here, as the other imports fail in main)

        sys.exit(vllm_half())
    main()
