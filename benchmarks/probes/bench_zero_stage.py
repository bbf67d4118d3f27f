"""One actor train step of the demo model under each ZeRO stage, one rank, no Ray: what a one-rank group pays
for ZeRO-3's per-module hooks when there is nothing to partition (why --zero_stage defaults to 2 for one-rank
trained groups, worker_config.zero_stage_of).

    for stage in --stages: a child process (world size 1, gloo) builds PolicyWorker on the demo model, runs 2
    warm-up steps, then --steps timed train_step calls on one fixed synthetic batch (256 rows, 24 prompt + 24
    response tokens, micro-batch 64, --use_kl_loss k3 as trl_compare's orlhf side) -> min and median seconds

Reproduce (2-core CPU box, ~1.5 min): .venv/bin/python benchmarks/probes/bench_zero_stage.py --threads 2
Results: benchmarks/results/2026-11-23-trl-compare-zero2.md.
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


def child(stage: int, threads: int, steps: int, port: int) -> dict:
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
    from orlhf.config.worker_config import role_config
    from orlhf.cpu.rank_actor import tune_rank_process
    from orlhf.demo.builder import ensure_demo
    from orlhf.types import Experience
    from orlhf.workers import PolicyWorker

    B, P, A, V = 256, 24, 24, 900
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
        model_path=str(ensure_demo().model),
        device="cpu",
        zero_stage=stage,
        micro_forward_batch_size=64,
        learning_rate=5e-4,
        train_batch_size=B,
        micro_train_batch_size=64,
        total_optimizer_steps=100,
        use_kl_loss=True,
        kl_coef=0.01,
        kl_estimator="k3",
    )
    worker = PolicyWorker(cfg)
    tune_rank_process()  # as orlhf's CPU rank processes do
    worker.init()
    for _ in range(2):
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
    ap.add_argument("--_child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, default=29611, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child is not None:
        print(json.dumps(child(a._child, a.threads, a.steps, a._port)), flush=True)
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
