"""A plain DeepSpeed engine on one rank (gloo, world size 1), the real model, in orlhf's tuned rank process: one
train step (2 micro-batches of 8 x 64 tokens, AdamW, clipping) under ZeRO-2 as orlhf configured one-rank groups
before (contiguous gradients off) against ZeRO-0 with the gradient all-reduce off (orlhf's one-rank fp32 default,
workers/base.py). Prints each step's seconds and a checksum of the weights after the steps (the two agree to float
rounding: ZeRO-2 steps a flat fp32 copy, ZeRO-0 the weights themselves).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/ds_one_rank_step.py s2 0     # mode, port offset
    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/ds_one_rank_step.py s0off 1
Results: benchmarks/results/2026-12-02-trl-compare-avx2.md.
"""

import json
import logging
import os
import sys
import time

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + int(sys.argv[2])), RANK="0", WORLD_SIZE="1")
os.environ.update(LOCAL_RANK="0", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from orlhf.cpu.rank_actor import tune_rank_process  # noqa: E402

tune_rank_process()
logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
mode = sys.argv[1]
torch.set_num_threads(2)
torch.manual_seed(0)
path = os.path.expanduser("~/.cache/orlhf/smollm2-135m-instruct-v1/model")  # orlhf make-demo --real
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
zero = {"stage": 0} if mode == "s0off" else {"stage": 2, "contiguous_gradients": False}
cfg = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "zero_optimization": zero,
    "gradient_clipping": 1.0,
    "zero_force_ds_cpu_optimizer": False,
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}
deepspeed.init_distributed(dist_backend="gloo")
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
if mode == "s0off":
    engine.enable_backward_allreduce = False
g = torch.Generator().manual_seed(1)
data = [torch.randint(0, 49152, (8, 64), generator=g) for _ in range(8)]
times = []
for step in range(5):
    t = time.perf_counter()
    for mb in range(2):
        x = data[(2 * step + mb) % 8]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    times.append(round(time.perf_counter() - t, 2))
checksum = sum(float(p.double().sum()) for p in engine.module.parameters())
print(json.dumps({"mode": mode, "step_s": times, "checksum": checksum}))
