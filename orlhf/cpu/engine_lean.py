"""What vLLM's LLM() builds at start-up for uses an orlhf engine never has, left out of a CPU engine's start.

    install()   in the engine's process, before LLM() (only for LEAN_FOR, the vLLM release this was checked
                against; otherwise vLLM's start stays as it is):
                - the renderer's tokenizer pool starts empty instead of holding renderer_num_workers + 1 deep
                  copies of the tokenizer; a call that needs one copies it then (vLLM's own fallback when its pool
                  is empty) and returns it to the pool
                - LLM()'s renderer warm-up skips rendering a chat message (it keeps the multimodal warm-up)
    vllm_start()   context manager: vLLM's own start meanwhile (tests compare the two)

Why: a CPU engine is the last process of a run to be ready, so its start-up is the run's (docs/cpu.md). Before the
first request, LLM() loads the tokenizer, deep-copies it twice for a pool that lets several threads tokenize at
once, and renders a chat message so that a first llm.chat() is quick; for a model whose processor is its tokenizer
(every text model), that rendering loads the tokenizer once more to look for the processor's chat template. A
deep copy of a tokenizer with a large vocabulary is as costly as loading it. orlhf's engines take token ids,
return token ids (detokenize=False) and never call chat(); only an agent's stop strings decode, and its first
such call then makes the one copy it needs.
"""

from __future__ import annotations

import logging
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


def install() -> bool:
    """Trim vLLM's start (module docstring) if this is the vLLM it was checked against; True if so."""
    import vllm
    from vllm.renderers import base, hf

    if vllm.__version__.split("+")[0] != LEAN_FOR:
        log.info(
            "vLLM %s: its own start-up (orlhf's trimmed one is checked against %s only)", vllm.__version__, LEAN_FOR
        )
        return False
    if not _vllm_own:
        _vllm_own["maybe_make_thread_pool"] = hf.maybe_make_thread_pool
        _vllm_own["warmup"] = base.BaseRenderer.warmup
    hf.maybe_make_thread_pool = _pool_empty_at_start
    base.BaseRenderer.warmup = _warmup_without_chat
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
