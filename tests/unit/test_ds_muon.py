"""cpu/ds_import.py: DeepSpeed's Muon module loaded without torch.compile's wrappers leaves a ZeRO-2 training
step unchanged and keeps torch._inductor's compiler out of the process. Each case runs in a fresh interpreter
(the point is what gets imported), with real DeepSpeed on one CPU rank."""

import json
import os
import subprocess
import sys

import pytest

STEP = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")
import torch
from orlhf.cpu import ds_import as ds_muon
from orlhf.workers.deepspeed_setup import init_distributed
if sys.argv[1] == "plain":
    ds_muon.CHECKED_VERSIONS = ()  # as on an unchecked DeepSpeed: the module loads as DeepSpeed imports it
ds_muon.load_deepspeed()  # as CpuRankActor does before a worker's init()
init_distributed("cpu")
import deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
       "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
x = torch.randn(4, 8)
for _ in range(2):
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
from deepspeed.runtime.zero.muon import muon_optimizer, original_muon
print(json.dumps({"params": [p.detach().flatten().tolist() for p in engine.module.parameters()],
                  "compile_fx": "torch._inductor.compile_fx" in sys.modules,
                  "plain_fn": not hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable"),
                  "compile_restored": torch.compile.__module__ == "torch"}))
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STEP, mode, str(_free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_uncompiled_muon_leaves_a_zero2_step_unchanged_and_skips_inductor():
    pytest.importorskip("deepspeed")
    from importlib.metadata import version

    from orlhf.cpu.ds_import import CHECKED_VERSIONS

    if version("deepspeed") not in CHECKED_VERSIONS:
        pytest.skip("ds_muon applies to the checked DeepSpeed versions only")
    fast, plain = _run("fast"), _run("plain")
    assert fast["params"] == plain["params"]  # bit-identical after two ZeRO-2 steps
    assert not fast["compile_fx"] and plain["compile_fx"]  # the import it saves, and that DeepSpeed makes it
    assert fast["plain_fn"] and not plain["plain_fn"]
    assert fast["compile_restored"] and plain["compile_restored"]


def test_other_deepspeed_versions_and_loaded_modules_are_left_alone(monkeypatch):
    from orlhf.cpu import ds_import as ds_muon

    monkeypatch.setattr(ds_muon, "CHECKED_VERSIONS", ())
    assert ds_muon.load_muon_uncompiled() is False
    monkeypatch.setitem(sys.modules, ds_muon.MUON_MODULE, object())
    monkeypatch.setattr(ds_muon, "CHECKED_VERSIONS", ("0.19.8",))
    assert ds_muon.load_muon_uncompiled() is False
