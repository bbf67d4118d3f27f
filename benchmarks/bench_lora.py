"""LoRA against full fine-tuning on one actor rank: parameters that train, optimizer state, what a weight sync
moves, train-step seconds and the process's peak memory, per model size (CPU, one rank, no Ray).

LoRA's case is memory and traffic: only the adapter trains, so Adam keeps state for the adapter alone, and a
weight sync sends the adapted modules merged (W + scaling * B @ A) instead of every weight. This measures how much
of that shows up in orlhf's own actor (workers/lora.py), and what it costs or saves in train-step time, where the
frozen base still runs its full forward and its backward for the activations' gradients.

    for preset in --presets, for mode in (full, lora): a FRESH child process (this script with --child, so the
    peak RSS is that mode's alone; world size 1, gloo) builds PolicyWorker from the flags bench_train_step.py
    passes (ZeRO-2 as a one-rank group runs, fp32, micro-batch 64, k3 KL loss 0.01), with lr 5e-4 for full
    fine-tuning and 5e-3 with LoRA (rank --rank, alpha 2 x rank, all-linear) -> bench_train_step's demo-shaped
    batch (64 demo prompts x 4, 24-token responses) -> the reference log-probs from the actor itself (adapter off
    with LoRA; the untouched weights without) -> --warmup untimed train steps, --repeats timed ones
    -> total and trainable parameters; optimizer state bytes (the torch optimizer's state tensors under
    DeepSpeed's ZeRO wrapper: Adam's two moments per trained parameter) and ZeRO's fp32 partition of the trained
    parameters (the copy the optimizer steps); bytes one weight sync sends (weight_groups_meta with vLLM's Llama
    fused-module map); train_step wall seconds (median, min); peak RSS (ru_maxrss after the steps) and the
    peak before the worker is built (the imports: torch, DeepSpeed, orlhf and peft, imported in both modes)

The table prints one row per preset x mode and the LoRA / full ratios per preset; the last line is the JSON of
everything (--out FILE also writes it). Peak RSS includes the imports each child pays alike, so its ratio
understates the difference in the model's own memory: the table also gives peak minus the pre-worker peak (the
worker's share: model, gradients, optimizer, activations). The byte counts are exact.

Reproduce: PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_lora.py --warmup 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

MODES = ("full", "lora")
LR = {"full": 5e-4, "lora": 5e-3}
# vLLM's Llama packed_modules_mapping: the modules it fuses, so a LoRA sync sends each fused module whole
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
NEW_TOKENS = 24  # bench_train_step's response length; the model needs room for the demo's 64 + these


def flags_for(preset: str, mode: str, rank: int) -> dict:
    """The train-ppo flags of one mode: bench_train_step's, on the preset's model, with LoRA when asked. Presets
    other than the demo get the demo's prompts, reward and preset values spelled out (as trl_compare does)."""
    from bench_train_step import FLAGS
    from model_presets import preset_model

    from orlhf.config.flags import DEMO_PRESET
    from orlhf.demo.builder import ensure_demo

    flags = {**FLAGS, "actor_learning_rate": LR[mode]}
    if preset != "demo":
        demo = ensure_demo()
        flags = {
            **DEMO_PRESET,
            **flags,
            "pretrain": str(preset_model(preset, max_len=64 + NEW_TOKENS)),
            "prompt_data": str(demo.prompts),
            "remote_rm_url": str(demo.reward_fn),
        }
    if mode == "lora":
        flags.update(lora_rank=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return flags


def torch_optimizer(engine):
    """The torch optimizer under DeepSpeed's wrappers (ZeRO-1/2's DeepSpeedZeroOptimizer holds it as .optimizer)."""
    import torch

    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def optimizer_state_bytes(opt) -> int:
    import torch

    return sum(t.nbytes for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor))


def child(preset: str, mode: str, rank: int, warmup: int, repeats: int, threads: int, port: int) -> dict:
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
    import peft  # noqa: F401  (both modes pay its import: the RSS difference is then the model's, not peft's)
    from bench_train_step import demo_batch, experience

    from orlhf.config.resolve import finish_config
    from orlhf.config.worker_config import worker_config
    from orlhf.cpu.rank_actor import tune_rank_process
    from orlhf.rollout.weight_sync import _nbytes
    from orlhf.workers import PolicyWorker

    flags = flags_for(preset, mode, rank)
    cfg = finish_config(flags, frozenset(flags))
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # imports, before any model
    wcfg = worker_config(cfg, "actor", warmup + repeats + 1)
    actor = PolicyWorker(wcfg)
    tune_rank_process()  # as orlhf's CPU rank processes do
    t0 = time.perf_counter()
    actor.init()
    init_s = time.perf_counter() - t0
    params = list(actor.engine.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in params if p.requires_grad)
    metas = [m for group in actor.weight_groups_meta(PACKED) for m in group]

    batch, g = demo_batch(cfg)
    ref_lp = actor.base_log_probs(batch) if mode == "lora" else actor.log_probs(batch)
    exp = experience(batch, ref_lp, g)
    for _ in range(warmup):
        actor.train_step(exp)
    times, stats = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        stats = actor.train_step(exp)
        times.append(time.perf_counter() - t)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    opt = torch_optimizer(actor.engine)
    fp32_groups = getattr(actor.engine.optimizer, "single_partition_of_fp32_groups", None) or []
    return {
        "preset": preset,
        "mode": mode,
        "zero_stage": wcfg.zero_stage,
        "lora": {"rank": rank, "alpha": 2 * rank, "target_modules": "all-linear"} if mode == "lora" else None,
        "learning_rate": LR[mode],
        "threads": threads,
        "shape": list(batch.sequences.shape),
        "total_params": total,
        "trainable_params": trainable,
        "optimizer": f"{type(actor.engine.optimizer).__name__}({type(opt).__name__})",
        "optimizer_state_bytes": optimizer_state_bytes(opt),
        "zero_fp32_partition_bytes": sum(t.nbytes for t in fp32_groups),
        "sync_tensors": len(metas),
        "sync_bytes": sum(_nbytes(m) for m in metas),
        "init_s": round(init_s, 3),
        "train_step_s_median": statistics.median(times),
        "train_step_s_min": min(times),
        "train_step_s": [round(x, 3) for x in times],
        "peak_rss_kib": peak_kib,
        "rss_before_worker_kib": rss_before_kib,
        "last_stats": {k: v for k, v in vars(stats).items() if isinstance(v, (int, float))},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(a, preset: str, mode: str) -> dict:
    cmd = [sys.executable, "-W", "ignore", __file__, "--child", f"{preset}:{mode}", "--rank", str(a.rank)]
    cmd += ["--warmup", str(a.warmup), "--repeats", str(a.repeats), "--threads", str(a.threads)]
    cmd += ["--port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"{preset} {mode} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


RATIO_KEYS = (
    "trainable_params",
    "optimizer_state_bytes",
    "sync_bytes",
    "train_step_s_median",
    "peak_rss_kib",
    "worker_rss_kib",
)


def ratios(full: dict, lora: dict) -> dict:
    worker = {m: r["peak_rss_kib"] - r["rss_before_worker_kib"] for m, r in (("full", full), ("lora", lora))}
    values = {m: {**r, "worker_rss_kib": worker[m]} for m, r in (("full", full), ("lora", lora))}
    return {k: values["lora"][k] / values["full"][k] if values["full"][k] else None for k in RATIO_KEYS}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(results: dict) -> str:
    head = (
        "| preset | mode | params (M) | trainable (M) | trainable % | optimizer state (MiB) | ZeRO fp32 copy (MiB) "
        "| sync (MiB) | sync tensors | train_step s (median) | peak RSS (MiB) | worker's share (MiB) |"
    )
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for preset, r in results.items():
        for mode in MODES:
            m = r[mode]
            rows.append(
                f"| {preset} | {mode if mode == 'full' else 'lora r' + str(m['lora']['rank'])} "
                f"| {m['total_params'] / 1e6:.2f} | {m['trainable_params'] / 1e6:.3f} "
                f"| {100 * m['trainable_params'] / m['total_params']:.2f} | {mib(m['optimizer_state_bytes'])} "
                f"| {mib(m['zero_fp32_partition_bytes'])} | {mib(m['sync_bytes'])} | {m['sync_tensors']} "
                f"| {m['train_step_s_median']:.3f} | {m['peak_rss_kib'] / 1024:.0f} "
                f"| {(m['peak_rss_kib'] - m['rss_before_worker_kib']) / 1024:.0f} |"
            )
    rows += [
        "",
        "LoRA / full:",
        "",
        "| preset | trainable | optimizer state | sync bytes | train_step s | peak RSS | worker's share |",
    ]
    rows.append("|---|---|---|---|---|---|---|")
    for preset, r in results.items():
        q = r["lora_over_full"]
        rows.append(f"| {preset} | " + " | ".join(f"{q[k]:.3f}" for k in RATIO_KEYS) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="demo,medium", help="model presets (benchmarks/model_presets.py)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha is 2 x rank)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # PRESET:MODE, run in a fresh process
    ap.add_argument("--port", type=int, default=29653, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        preset, mode = a.child.split(":")
        print(json.dumps(child(preset, mode, a.rank, a.warmup, a.repeats, a.threads, a.port)), flush=True)
        return

    from model_presets import parse_presets, preset_model

    presets = parse_presets(a.presets)
    results: dict = {}
    load0 = os.getloadavg()
    for preset in presets:
        preset_model(preset, max_len=64 + NEW_TOKENS)  # built here once, not inside a child's peak RSS
        r = results[preset] = {}
        for mode in MODES:
            m = r[mode] = run_child(a, preset, mode)
            print(
                f"{preset} {mode}: {m['trainable_params'] / 1e6:.3f}M of {m['total_params'] / 1e6:.2f}M train, "
                f"optimizer state {mib(m['optimizer_state_bytes'])} MiB, sync {mib(m['sync_bytes'])} MiB, "
                f"train_step {m['train_step_s_median']:.3f} s median, peak RSS {m['peak_rss_kib'] / 1024:.0f} MiB",
                flush=True,
            )
        r["lora_over_full"] = ratios(r["full"], r["lora"])
    print()
    print(table(results))
    res = {
        "rank": a.rank,
        "alpha": 2 * a.rank,
        "warmup": a.warmup,
        "repeats": a.repeats,
        "threads": a.threads,
        "packed_modules": PACKED,
        "load_avg_before": load0,
        "load_avg_after": os.getloadavg(),
        "results": results,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
