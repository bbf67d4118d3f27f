"""A CPU engine's start without the tokenizer copies and chat warm-up orlhf never uses (cpu/engine_lean.py), on
vLLM's own renderer for the demo model: vLLM's start makes its pool's copies and loads the processor to warm up
chat; the trimmed one makes neither, and its tokenizer decodes the same, copying once on first use."""

import os
import queue

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def renderer_parts():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import base, hf
    from vllm.tokenizers import cached_tokenizer_from_config

    from orlhf.cpu import engine_lean
    from orlhf.demo.builder import ensure_demo

    before = hf.maybe_make_thread_pool, base.BaseRenderer.warmup
    assert engine_lean.install(), "the pinned vLLM should get the trimmed start"
    config = EngineArgs(model=str(ensure_demo().model), enforce_eager=True, dtype="float32").create_engine_config()
    yield config, cached_tokenizer_from_config(config.model_config)
    hf.maybe_make_thread_pool, base.BaseRenderer.warmup = before


def _pool(tokenizer) -> queue.Queue:
    """The queue of copies behind vLLM's thread-safe tokenizer (maybe_make_thread_pool's closure)."""
    todo = [type(tokenizer).decode]
    while todo:
        for cell in getattr(todo.pop(), "__closure__", None) or ():
            value = cell.cell_contents
            if isinstance(value, queue.Queue):
                return value
            if callable(value):
                todo.append(getattr(value, "__wrapped__", value))
    raise AssertionError("no tokenizer pool found")


def test_start_makes_no_tokenizer_copies_nor_chat_warmup_and_decodes_the_same(renderer_parts):
    from vllm.renderers import hf
    from vllm.renderers.hf import HfRenderer
    from vllm.renderers.params import ChatParams

    from orlhf.cpu.engine_lean import vllm_start

    config, tokenizer = renderer_parts
    ids = tokenizer.encode("say colors: red blue cat")
    hf._PROCESSOR_CHAT_TEMPLATES.clear()
    with vllm_start():
        own = HfRenderer(config, tokenizer)
        own.warmup(ChatParams())
    assert _pool(own.tokenizer).qsize() == config.model_config.renderer_num_workers + 1
    assert len(hf._PROCESSOR_CHAT_TEMPLATES) == 1  # the chat warm-up looked for the processor's template

    hf._PROCESSOR_CHAT_TEMPLATES.clear()
    lean = HfRenderer(config, tokenizer)
    lean.warmup(ChatParams())
    assert _pool(lean.tokenizer).qsize() == 0 and not hf._PROCESSOR_CHAT_TEMPLATES
    assert lean.tokenizer.decode(ids) == own.tokenizer.decode(ids) == tokenizer.decode(ids)
    assert _pool(lean.tokenizer).qsize() == 1  # the copy the first call made, kept for the next
