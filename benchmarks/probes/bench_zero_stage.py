"""One actor train step under each ZeRO stage, one rank, no Ray: what a one-rank group pays for ZeRO when there is
nothing to partition (ZeRO-3's per-module hooks; ZeRO-1/2's gradient bucket and second fp32 copy), which is why
one-rank trained groups default to no ZeRO (worker_config.zero_stage_of).

    for stage in --stages: a child process (world size 1, gloo) builds PolicyWorker on the model (the demo's, or
    --model), runs --warmup (2) untimed steps, then --steps timed train_step calls on one fixed synthetic batch
    (--rows rows, 24 prompt + 24 response tokens, micro-batch --micro or min(64, rows), --use_kl_loss k3 as
    trl_compare's orlhf side) -> min and median seconds

Reproduce (2-core CPU box, ~1.5 min): .venv/bin/python benchmarks/probes/bench_zero_stage.py --threads 2
The real model as trl_compare trains it (64 rows in micro-batches of 16, ~6 min):
    ... --model ~/.cache/orlhf/smollm2-135m-instruct-v1/model --rows 64 --micro 16 --stages 2,0 --steps 3
Results: benchmarks/results/2026-11-23-trl-compare-zero2.md, benchmarks/results/2026-12-02-trl-compare-avx2.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(stage, threads, steps, port, model: str | None, rows: int, micro: int | None, warmup: int = 2) -> dict:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
    )
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoConfig

    from orlhf.config.worker_config import role_config
    from orlhf.cpu.rank_actor import tune_rank_process
    from orlhf.demo.builder import ensure_demo
    from orlhf.types import Experience
    from orlhf.workers import PolicyWorker

    model = model or str(ensure_demo().model)
    B, P, A, V = rows, 24, 24, min(AutoConfig.from_pretrained(model).vocab_size, 50_000)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(4, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    for i in range(B):  # prompts of 12-24 real tokens (left pads), responses of 1-24 (right pads)
        attn[i, : i % 12] = 0
        attn[i, P + 1 + (i * 3) % A :] = 0
    exp = Experience(
        seq,
        attn,
        attn[:, -A:].bool(),
        action_log_probs=None,
        advantages=torch.randn(B, A, generator=g),
        base_action_log_probs=-torch.rand(B, A, generator=g),
        rollout_log_probs=-torch.rand(B, A, generator=g),
    )
    cfg = role_config(
        "actor",
        model_path=model,
        device="cpu",
        zero_stage=stage,
        micro_forward_batch_size=min(64, B),
        learning_rate=5e-4,
        train_batch_size=B,
        micro_train_batch_size=micro or min(64, B),
        total_optimizer_steps=100,
        use_kl_loss=True,
        kl_coef=0.01,
        kl_estimator="k3",
    )
    worker = PolicyWorker(cfg)
    tune_rank_process()  # as orlhf's CPU rank processes do
    worker.init()
    for _ in range(warmup):
        worker.train_step(exp)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        worker.train_step(exp)
        times.append(time.perf_counter() - t)
    return {
        "stage": stage,
        "threads": threads,
        "min_s": min(times),
        "median_s": statistics.median(times),
        "steps_s": [round(x, 3) for x in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", default="3,2,0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--model", default=None, help="an HF folder (default: the tiny demo's model)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (0: time the first steps too)")
    ap.add_argument("--micro", type=int, default=None, help="train micro-batch (default: min(64, rows))")
    ap.add_argument("--_child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, default=29611, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child is not None:
        print(json.dumps(child(a._child, a.threads, a.steps, a._port, a.model, a.rows, a.micro, a.warmup)), flush=True)
        return
    results = []
    for i, stage in enumerate(int(s) for s in a.stages.split(",")):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run(
            [
                sys.executable,
                "-W",
                "ignore",
                __file__,
                "--_child",
                str(stage),
                "--threads",
                str(a.threads),
                "--steps",
                str(a.steps),
                "--_port",
                str(a._port + i),
                "--rows",
                str(a.rows),
                *(["--model", a.model] if a.model else []),
                *(["--micro", str(a.micro)] if a.micro else []),
                "--warmup",
                str(a.warmup),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"ZeRO-{stage}: train step min {r['min_s']:.3f} s, median {r['median_s']:.3f} s ({a.threads} threads)",
            flush=True,
        )
    print(json.dumps({"results": results, "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
