"""What vLLM's in-place reload leaves stale, and the fix-ups orlhf wraps around every reload.

vLLM (0.32) reloads layer by layer: each module that receives weights is rebuilt, loaded, post-processed
(`quant_method.process_weights_after_loading`: on CPU this pre-packs linear weights into oneDNN / sgl-kernel
layouts, MoE experts into the grouped-GEMM layout) and copied back into its old storage. Two kinds of modules
come out of that with pre-packed data that no longer matches their weights:

1. Modules that share a weight with another (a tied LM head is `embed_tokens.weight`): if the sync does not
   name them (vLLM skips `lm_head.*` when the config ties), they load nothing, vLLM puts their old tensors back
   ("ParallelLMHead: Failed to load weights") and never re-packs them; the shared storage has the new weights
   but the head's packed copy is the step-0 head. Fix: after the reload, post-process every module that shares
   a parameter with a module the reload post-processed and was not post-processed itself.
2. MoE experts on CPU: on the first load vLLM converts the experts to kernel format and then pre-packs them; on
   a reload it takes the "weight update" path, copies the kernel-format weights into the already pre-packed
   storage and skips the pre-pack, so the engine reads raw weights as packed ones and matches neither the old
   nor the new policy. Fix: for the reload, drop the layer's MoE kernel so vLLM sets it up as on a first load
   (convert, build the kernel, pre-pack), which its copy-back then writes into the old storage. Only layers
   whose experts pre-pack are touched (none on GPU).

Both hold for a sync of the whole model in one reload call and for a LoRA sync of some modules (workers/lora.py):
modules a sync leaves out keep their tensors, packed data included, and so stay right. `modules_left_out` keeps
vLLM's one warning per such module out of the engine's log.

`stale_packs` checks the outcome of 1, apart from the fix: a module whose weights another module shares, whose
values changed in the reload while its own post-processing did not run, computes with a pre-packed copy of the old
values. A tied head left so differs from the synced policy by one update, which at a small learning rate is under
what the sync guard's gap can see; this sees it at the sync itself, in any dtype.
"""

from __future__ import annotations

import logging
import zlib
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger(__name__)


def _experts_prepack(quant_method) -> bool:
    kernel = getattr(quant_method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return False
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:  # another vLLM layout: leave the layer to vLLM
        return False
    return type(experts).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading


@contextmanager
def refreshed_after_reload(model: nn.Module):
    """Wrap one `reload_weights` call on `model` (the engine's nn.Module) with the two fix-ups above."""
    processed: set[int] = set()
    wrapped, moe_layers = [], []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or not hasattr(qm, "process_weights_after_loading"):
            continue
        if _experts_prepack(qm):
            moe_layers.append((module, qm, qm.moe_kernel))
        if id(qm) not in {id(q) for q, _ in wrapped}:
            wrapped.append((qm, "process_weights_after_loading" in vars(qm)))
            qm.process_weights_after_loading = _recording(qm.process_weights_after_loading, processed)
    for _, qm, _ in moe_layers:
        qm.moe_kernel = None  # vLLM's _setup_kernel: no kernel yet = first load = convert + pre-pack
    try:
        yield
    finally:
        for qm, had_own in wrapped:
            if had_own:
                qm.process_weights_after_loading = qm.process_weights_after_loading.__wrapped__
            else:
                del qm.process_weights_after_loading
        for module, qm, old_kernel in moe_layers:
            if qm.moe_kernel is None:  # the reload did not reach this layer: keep it as it was
                qm.moe_kernel = old_kernel
                log.debug("%s was not in this sync: its experts keep their weights", type(module).__name__)
    _reprocess_tied(model, processed)


class _LeftOut(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


@contextmanager
def modules_left_out():
    """Silence vLLM's "<Module>: Failed to load weights" for the modules a partial sync does not hold (a LoRA sync
    sends the adapted modules only; vLLM keeps the others' tensors, which is what is wanted)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = _LeftOut()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextmanager
def weights_not_loaded():
    """The names of the model's weights one reload found no tensor for, as a set filled when the reload ends: vLLM
    checks this itself after `reload_weights` and says it in one warning ("Following weights were not loaded from
    checkpoint: {...}"), which is taken here instead of reaching the engine's log. The warning is made sure of
    whatever vLLM's logging level (VLLM_LOGGING_LEVEL)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    names: set[str] = set()
    taken = _NotLoaded(names)
    level = logger.level
    if not logger.isEnabledFor(logging.WARNING):
        logger.setLevel(logging.WARNING)
    logger.addFilter(taken)
    try:
        yield names
    finally:
        logger.removeFilter(taken)
        logger.setLevel(level)


class _NotLoaded(logging.Filter):
    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Following weights were not loaded"):
            return True
        if record.args and isinstance(record.args[0], (set, frozenset, list, tuple)):
            self.names.update(str(n) for n in record.args[0])
        else:  # another vLLM's wording of the arguments: the names as printed
            self.names.add(record.getMessage().split(":", 1)[-1].strip())
        return False


@contextmanager
def stale_packs(model: nn.Module):
    """Around one reload (outside `refreshed_after_reload`, so that its re-processing counts): yields a set, filled
    when the reload ends with the names of the modules left computing with stale pre-packed weights. Watched: the
    modules with a post-processing step whose weight tensor another module shares (a tied head and its embedding);
    a content fingerprint of each shared tensor before and after the reload, and the modules post-processed in it.
    Stale: the values changed and the module was not post-processed. Modules sharing nothing are post-processed by
    vLLM whenever they receive weights, and others' writes cannot reach them."""
    shared = _shared_processing_modules(model)
    before = {ptr: _fingerprint(t) for ptr, (t, _) in shared.items()}
    processed: set[int] = set()
    wrapped = []
    for _, modules in shared.values():
        for _, module in modules:
            qm = module.quant_method
            if id(qm) not in {id(q) for q, _ in wrapped}:
                wrapped.append((qm, "process_weights_after_loading" in vars(qm)))
                qm.process_weights_after_loading = _recording(qm.process_weights_after_loading, processed)
    stale: set[str] = set()
    try:
        yield stale
    finally:
        for qm, had_own in wrapped:
            if had_own:
                qm.process_weights_after_loading = qm.process_weights_after_loading.__wrapped__
            else:
                del qm.process_weights_after_loading
    for ptr, (tensor, modules) in shared.items():
        if _fingerprint(tensor) != before[ptr]:
            stale.update(name for name, m in modules if id(m) not in processed)
    if stale:
        log.warning("modules left with stale pre-packed weights after the reload: %s", sorted(stale))


def _shared_processing_modules(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[str, nn.Module]]]]:
    """{storage pointer: (the tensor, [(name, module)])} for each weight held by two or more modules, keeping those
    of them that post-process their weights (a quant_method with process_weights_after_loading)."""
    owners: dict[int, tuple[torch.Tensor, list[tuple[str, nn.Module]]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if p.numel() > 0:
                owners.setdefault(p.data_ptr(), (p, []))[1].append((name, module))
    return {
        ptr: (
            t,
            [(n, m) for n, m in mods if hasattr(getattr(m, "quant_method", None), "process_weights_after_loading")],
        )
        for ptr, (t, mods) in owners.items()
        if len(mods) > 1
        and any(hasattr(getattr(m, "quant_method", None), "process_weights_after_loading") for _, m in mods)
    }


def _fingerprint(t: torch.Tensor) -> object:
    """A value that changes whenever the tensor's values change, but for vanishing odds. On the CPU the CRC-32 of
    its bytes: one pass over them, no copy (zlib releases the GIL meanwhile). Elsewhere the sum and the sum of
    squares of its values in float64, a slice at a time (no fp64 copy of a whole embedding): a change that keeps
    both is not seen; an optimizer step moves both."""
    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.is_contiguous():
        return zlib.crc32(flat.view(torch.uint8).numpy())
    total = squares = 0.0
    for chunk in flat.split(1 << 22):
        c = chunk.double()
        total += c.sum().item()
        squares += c.square().sum().item()
    return total, squares


def _recording(fn, processed: set[int]):
    def process_weights_after_loading(layer, *args, **kwargs):
        processed.add(id(layer))
        return fn(layer, *args, **kwargs)

    process_weights_after_loading.__wrapped__ = fn
    return process_weights_after_loading


def _reprocess_tied(model: nn.Module, processed: set[int]) -> list[str]:
    """Post-process modules that share a weight with a post-processed module but were skipped themselves."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if p.numel() > 0:  # processed linears keep an empty placeholder: not a shared weight
                owners.setdefault(p.data_ptr(), []).append((name, module))
    redone = []
    for sharing in owners.values():
        if len(sharing) < 2 or not any(id(m) in processed for _, m in sharing):
            continue
        for name, module in sharing:
            qm = getattr(module, "quant_method", None)
            if id(module) not in processed and qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(module)
                redone.append(name)
    if redone:
        log.debug("re-processed tied modules after reload: %s", redone)
    return redone
