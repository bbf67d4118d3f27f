"""The CUDA IPC sync's loading scheme, on vLLM's CPU build: one layerwise reload spanning many calls.

    orlhf_ipc_begin -> _orlhf_load_group(layer) x N -> orlhf_ipc_finish      (the extension's own methods)

The IPC path loads a sync layer by layer across several collective_rpc calls (CUDA handles exist for one layer
at a time), so vLLM's reload must stay open between calls. CUDA handles cannot be made on CPU; everything after
them can: here the layers come from a safetensors file, and the engine's log-probs must then equal transformers'
on the new weights. vLLM runs in a subprocess (in-process engine: it initialises torch.distributed).
"""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm

ENGINE_SCRIPT = r"""
import json, os, re, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model_dir, new_weights, seqs_file, out = sys.argv[1:5]
seqs = json.load(open(seqs_file))
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=128 * 2**20,
          max_model_len=256, worker_extension_cls="orlhf.rollout.worker_ext.WeightSyncExtension", seed=0)

def logprobs():
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
    return [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for s, o in zip(seqs, outs)]

def sync_layer_by_layer(worker, path):
    from safetensors.torch import load_file
    from orlhf.workers.full_weights import LAYER_PREFIX
    groups = {"": []}
    for name, t in load_file(path).items():
        m = LAYER_PREFIX.match(name)
        groups.setdefault(m.group(1) if m else "", []).append((name, t))
    worker.orlhf_ipc_begin()
    for group in groups.values():
        worker._orlhf_load_group(group)
    worker.orlhf_ipc_finish()
    return len(groups)

before = logprobs()
calls = llm.collective_rpc(sync_layer_by_layer, args=(new_weights,))
llm.reset_prefix_cache()
json.dump({"before": before, "after": logprobs(), "calls": calls}, open(out, "w"))
"""


def test_one_reload_across_per_layer_calls_gives_the_new_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from orlhf.demo.builder import ensure_demo

    model_dir = str(ensure_demo().model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    new_dir = tmp_path / "new"
    model.save_pretrained(new_dir)
    seqs = [[1] + list(range(10 + i, 30 + 2 * i)) for i in range(4)]
    (tmp_path / "seqs.json").write_text(json.dumps(seqs))
    out = tmp_path / "out.json"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            ENGINE_SCRIPT,
            model_dir,
            str(new_dir / "model.safetensors"),
            str(tmp_path / "seqs.json"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["calls"][0] >= 3  # the embeddings/head group plus one per decoder layer
    with torch.no_grad():
        for seq, before, after in zip(seqs, res["before"], res["after"]):
            ids = torch.tensor([seq])
            want = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            want = want.gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert (torch.tensor(after) - want).abs().max() <= 1e-3
            assert (torch.tensor(before) - want).abs().max() > 1e-2  # the engine did change models
