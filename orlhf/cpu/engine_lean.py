"""What a CPU engine's vLLM does that orlhf's use of it does not need, left out: at LLM()'s start, and in how the
KV cache's memory is touched.

    install()   in the engine's process, before LLM() (only for LEAN_FOR, the vLLM release this was checked
                against; otherwise vLLM's start stays as it is):
                - the renderer's tokenizer pool starts empty instead of holding renderer_num_workers + 1 deep
                  copies of the tokenizer; a call that needs one copies it then (vLLM's own fallback when its pool
                  is empty) and returns it to the pool
                - LLM()'s renderer warm-up skips rendering a chat message (it keeps the multimodal warm-up)
                - the KV cache's memory is a fresh private anonymous mapping, whose pages the OS hands out zeroed
                  when first touched, instead of torch.zeros writing every page of it before the first request;
                  vLLM lays out the per-layer views as before (on a meta buffer), and they are placed on it
                - after a prefix-cache reset (orlhf's after every weight sync), the free blocks are handed out
                  lowest id first again, as after the start
    vllm_start()   context manager: vLLM's own start meanwhile (tests compare the two)

Why: a CPU engine is the last process of a run to be ready, so its start-up is the run's (docs/cpu.md). Before the
first request, LLM() loads the tokenizer, deep-copies it twice for a pool that lets several threads tokenize at
once, and renders a chat message so that a first llm.chat() is quick; for a model whose processor is its tokenizer
(every text model), that rendering loads the tokenizer once more to look for the processor's chat template. A
deep copy of a tokenizer with a large vocabulary is as costly as loading it. orlhf's engines take token ids,
return token ids (detokenize=False) and never call chat(); only an agent's stop strings decode, and its first
such call then makes the one copy it needs.

Why the KV cache's pages: vLLM allocates the whole cache at once with torch.zeros, which writes every byte, one page
fault per 4 KiB; for the automatic size that is up to a GiB (cpu/engine_kv.py), the largest single cost of LLM()
on a small model, paid while every other process of the run waits for the engine. The mapping holds the same zeros
(the kernel's guarantee for anonymous memory), but a page costs its fault only when the engine first writes a key
or value there, so the cost moves from the start to the blocks generation actually uses, and the resident memory
grows with them. The tensors vLLM gets have the dtypes, shapes, strides and aliasing its own allocation gives.

Why the order after a reset: vLLM's free queue hands out the block freed longest ago first (its eviction order for
cached prefixes), so from step to step an engine would walk on through blocks it never used, touching the whole
cache after a few steps; every page would cost its fault then, and the resident memory would reach the whole
cache. After a reset no block holds anything another request could reuse, so the order of the free queue is
free to choose: lowest id first, as vLLM builds it at the start, and each step writes the pages the step before
wrote. Which block holds a token changes no computed value.
"""

from __future__ import annotations

import logging
import mmap
from contextlib import contextmanager

log = logging.getLogger(__name__)

LEAN_FOR = "0.32.0"  # the vLLM release whose start this trims (tests/vllm/test_engine_lean.py)

_vllm_own: dict = {}  # what install() replaced: name -> vLLM's own
_vllm_only = False  # vllm_start(): vLLM's own meanwhile


def _pool_empty_at_start(tokenizer, copies: int = 1):
    """vLLM's maybe_make_thread_pool with no copies made up front (the pool copies on first use)."""
    return _vllm_own["maybe_make_thread_pool"](tokenizer, copies if _vllm_only else 0)


def _warmup_without_chat(self, chat_params) -> None:
    """vLLM 0.32's BaseRenderer.warmup without its chat-template part: the multimodal warm-up, as vLLM runs it."""
    if _vllm_only:
        return _vllm_own["warmup"](self, chat_params)
    if self._mm_warmup_future is not None:
        self._join_mm_warmup()
    self.warmup_mm()


def _allocate_kv_cache_on_fresh_pages(kv_cache_config, device, layout, kernel_block_sizes=None):
    """vLLM 0.32's allocate_kv_cache (v1/worker/utils.py) for a CPU engine, with its backing memory a fresh anonymous
    mapping (module docstring): vLLM's own function lays the views out on a meta buffer of the same size, and each
    view is placed at the same offset, shape and stride of the mapping."""
    import torch

    own = _vllm_own["allocate_kv_cache"]
    if _vllm_only or torch.device(device).type != "cpu":
        return own(kv_cache_config, device, layout, kernel_block_sizes)
    laid_out = own(kv_cache_config, torch.device("meta"), layout, kernel_block_sizes)
    if not laid_out:
        return laid_out
    sizes = {t.size for t in kv_cache_config.kv_cache_tensors}  # vLLM asserts one backing allocation
    storage = zero_pages(sizes.pop()).untyped_storage()
    placed: dict[int, torch.Tensor] = {}  # one tensor per laid-out one: layers vLLM gave one tensor keep sharing it
    for layout_view in laid_out.values():
        if id(layout_view) not in placed:
            t = torch.empty(0, dtype=layout_view.dtype)
            t.set_(storage, layout_view.storage_offset(), layout_view.shape, layout_view.stride())
            placed[id(layout_view)] = t
    return {name: placed[id(view)] for name, view in laid_out.items()}


def _reset_then_lowest_first(self) -> bool:
    """vLLM 0.32's BlockPool.reset_prefix_cache, then, when it succeeded (every block but the null block is free),
    the free queue rebuilt in block id order, as BlockPool's constructor builds it (module docstring)."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    done = _vllm_own["reset_prefix_cache"](self)
    if done and not _vllm_only:
        free = [block for block in self.blocks if not block.is_null]
        if len(free) == self.free_block_queue.num_free_blocks:
            self.free_block_queue = FreeKVCacheBlockQueue(free)
    return done


def zero_pages(nbytes: int):
    """A 1-D int8 CPU tensor of `nbytes` zeros on a private anonymous mapping of its own: its pages are faulted in,
    zeroed by the kernel, when first touched. The mapping lives as long as the tensor's storage."""
    import torch

    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.int8)


def install() -> bool:
    """Trim vLLM's start (module docstring) if this is the vLLM it was checked against; True if so."""
    import vllm
    from vllm.renderers import base, hf

    if vllm.__version__.split("+")[0] != LEAN_FOR:
        log.info(
            "vLLM %s: its own start-up (orlhf's trimmed one is checked against %s only)", vllm.__version__, LEAN_FOR
        )
        return False
    from vllm.v1.core import block_pool  # (modules of the checked release: another one may lack them)
    from vllm.v1.worker import gpu_model_runner

    if not _vllm_own:
        _vllm_own["maybe_make_thread_pool"] = hf.maybe_make_thread_pool
        _vllm_own["warmup"] = base.BaseRenderer.warmup
        _vllm_own["allocate_kv_cache"] = gpu_model_runner.allocate_kv_cache  # the CPU runner's, imported by name
        _vllm_own["reset_prefix_cache"] = block_pool.BlockPool.reset_prefix_cache
    hf.maybe_make_thread_pool = _pool_empty_at_start
    base.BaseRenderer.warmup = _warmup_without_chat
    gpu_model_runner.allocate_kv_cache = _allocate_kv_cache_on_fresh_pages
    block_pool.BlockPool.reset_prefix_cache = _reset_then_lowest_first
    return True


@contextmanager
def vllm_start():
    """Inside the block, an engine starts as vLLM's own does (for comparisons)."""
    global _vllm_only
    before, _vllm_only = _vllm_only, True
    try:
        yield
    finally:
        _vllm_only = before
