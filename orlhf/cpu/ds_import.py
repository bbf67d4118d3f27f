"""DeepSpeed's Muon optimizer module, loaded without compiling its kernels' wrappers (start-up CPU of a rank).

DeepSpeed 0.19.8 imports deepspeed.runtime.zero.muon.muon_optimizer whenever it sets up or runs a ZeRO optimizer
(is_zero_supported_optimizer at deepspeed.initialize, average_tensor at every ZeRO-1/2 gradient reduction), to
check whether the optimizer is its MuonWithAuxAdam. Importing that module applies torch.compile to three Muon
functions (original_muon.py, `@compiler.compile()`), and torch.compile's wrapper imports torch._inductor's
compiler (compile_fx, lowering, select_algorithm) in every training rank process, for functions only a Muon
optimizer calls (--actor_optim / --critic_optim muon). On CPU, inductor compiling them costs minutes of C++ builds
(one per shape) against milliseconds of eager Newton-Schulz on these ranks' matrices, so CPU ranks run them eager:
the same math.

load_muon_uncompiled() imports the module once with torch.compile standing aside (the decorator returns the plain
function), before DeepSpeed does: the classes are DeepSpeed's own (its isinstance checks are unchanged), only the
three Muon functions stay uncompiled. Applied only to the DeepSpeed version it was checked against; any
other version loads the module as it is. load_deepspeed() imports the rest of DeepSpeed first, so that only the
Muon modules load while torch.compile stands aside (CpuRankActor calls it before the worker's init()).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
CHECKED_VERSIONS = ("0.19.8",)  # original_muon.py's three @compiler.compile() functions, no other compile call


def load_muon_uncompiled() -> bool:
    """Import DeepSpeed's Muon module without torch.compile's wrappers, if this DeepSpeed is a checked one and
    the module is not loaded yet. Returns whether it did. Call before deepspeed.initialize."""
    if MUON_MODULE in sys.modules or "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return False
    try:
        if version("deepspeed") not in CHECKED_VERSIONS:
            return False
    except PackageNotFoundError:
        return False
    import importlib

    import torch

    compile_fn = torch.compile

    def plain(model=None, **kwargs):  # @torch.compile() -> a decorator; torch.compile(fn) -> fn
        return model if model is not None else (lambda fn: fn)

    torch.compile = plain
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        torch.compile = compile_fn
    return True


def load_deepspeed() -> bool:
    """Import DeepSpeed, then its Muon module uncompiled (module docstring). Returns load_muon_uncompiled's answer."""
    import deepspeed  # noqa: F401 - whole, before torch.compile stands aside

    return load_muon_uncompiled()
