"""A CPU engine's start without what orlhf never uses (cpu/engine_lean.py). On vLLM's own renderer for the demo
model: vLLM's start makes its pool's copies and loads the processor to warm up chat; the trimmed one makes neither,
and its tokenizer decodes the same, copying once on first use. In a real engine's process: its KV cache holds no
resident page after the start, pages come in as generation writes them, a generation after a prefix-cache reset
writes the same pages again (vLLM's own order would go on to others) and samples the same, and the tensors equal
vLLM's own allocation's (the same zeros, dtypes, shapes, strides and aliasing)."""

import json
import os
import queue
import subprocess
import sys

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


KV_SCRIPT = r"""
import json, os, sys
os.environ["OMP_NUM_THREADS"] = "1"
from orlhf.config.resolve import finish_config
from orlhf.cpu import engine_lean
from orlhf.cpu.tuning import CpuTuning
from orlhf.rollout.engine import EngineActor
from orlhf.rollout.engine_config import engine_config
from orlhf.types import SamplingSpec

calls = []
fresh_pages = engine_lean._allocate_kv_cache_on_fresh_pages
def recorded(*args):
    calls.append(args)
    return fresh_pages(*args)
engine_lean._allocate_kv_cache_on_fresh_pages = recorded  # what install() puts in vLLM's place

def resident_kib(t):  # the Rss of the mapping that holds t's storage (/proc/self/smaps)
    ptr = t.untyped_storage().data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= ptr < hi:
                return next(int(l.split()[1]) for l in lines[i + 1:] if l.startswith("Rss:"))
    raise AssertionError("no mapping holds the KV cache")

def layout(caches):  # each layer's tensor as vLLM uses it, its place relative to the backing memory
    base = next(iter(caches.values())).untyped_storage().data_ptr()
    return [(n, str(t.dtype), list(t.shape), list(t.stride()), t.data_ptr() - base, t.untyped_storage().nbytes())
            for n, t in caches.items()]

flags = {"device": "cpu", "vllm_cpu_kv_cache_gb": 0.25}
cfg = finish_config(flags, explicit=set(flags))
engine = EngineActor(engine_config(cfg), 0, tuning=CpuTuning.for_config(cfg))
kv = engine.llm.collective_rpc(lambda worker: worker.model_runner.kv_caches)[0]
out = {"allocations": len(calls), "layers": len(kv), "nbytes": kv[0].untyped_storage().nbytes(),
       "resident_after_start_kib": resident_kib(kv[0])}
prompt, spec = [(0, [5, 6, 7, 8, 9] * 8)], SamplingSpec(max_new_tokens=8, n=2, seed=1)
samples = [[r.response_ids for r in engine.generate(prompt, spec)]]
out["resident_kib"] = [resident_kib(kv[0])]
engine.reset_prefix_cache()  # as after a weight sync: the free blocks lowest id first again
samples.append([r.response_ids for r in engine.generate(prompt, spec)])
out["resident_kib"].append(resident_kib(kv[0]))
with engine_lean.vllm_start():
    engine.reset_prefix_cache()  # vLLM's own order: the blocks freed longest ago first, never used ones here
samples.append([r.response_ids for r in engine.generate(prompt, spec)])
out["resident_kib"].append(resident_kib(kv[0]))
out["samples"] = samples
lean = fresh_pages(*calls[0])
with engine_lean.vllm_start():
    own = fresh_pages(*calls[0])  # vLLM's own allocation (torch.zeros), with the same arguments
out["lean"], out["own"] = layout(lean), layout(own)
out["nonzero"] = sum(int(t.count_nonzero()) for t in lean.values())
json.dump(out, open(sys.argv[1], "w"))
"""


def test_kv_cache_pages_come_in_as_generation_writes_them_the_same_after_a_reset_and_the_tensors_are_vllms(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-c", KV_SCRIPT, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["allocations"] == 1 and res["layers"] >= 2 and res["nbytes"] == 2**28  # --vllm_cpu_kv_cache_gb 0.25
    assert res["resident_after_start_kib"] == 0  # torch.zeros would have written all 256 MiB
    first, after_reset, after_vllms_reset = res["resident_kib"]
    assert 0 < first < 2**18 // 16  # the blocks the first generation wrote, a small part of the 256 MiB
    assert after_reset == first  # the same blocks again after a reset
    assert after_vllms_reset > first  # vLLM's own order would have gone on to other pages
    assert res["samples"][0] == res["samples"][1] == res["samples"][2]  # wherever the blocks are, the same samples
    assert [len(ids) for ids in res["samples"][0]] == [8, 8]
    assert res["lean"] == res["own"] and res["nonzero"] == 0
