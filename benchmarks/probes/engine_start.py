"""A CPU engine's start through orlhf's EngineActor, no Ray, each start in a fresh process: the preloaded imports
(torch, transformers' model base, as a prestarted Ray worker has them), vLLM's import, then EngineActor (LLM() and
orlhf's tuning), with vLLM's KV cache allocation timed apart (its page touching varies most between machines).
Alternates orlhf's trimmed start (the eager engine's vLLM import, cpu/vllm_import.py; LLM() without what it never
uses, cpu/engine_lean.py) with vLLM's own, for an A/B in one invocation.

    orlhf make-demo --real DEMO
    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/engine_start.py --model DEMO/model --repeats 4

Prints one line per start and a JSON summary (medians per variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch, transformers.modeling_utils  # what cpu/preload.py gives a prestarted worker
t1 = time.perf_counter()
if sys.argv[2] != "vllm_own":  # an eager engine's import (cpu/vllm_import.py), as CpuTuning._start_engine does it
    from orlhf.cpu.vllm_import import import_vllm
    import_vllm()
from vllm import LLM  # noqa: F401
t2 = time.perf_counter()
from vllm.v1.worker import gpu_model_runner
kv = [0.0]
allocate = gpu_model_runner.allocate_kv_cache
def timed(*a, **k):
    s = time.perf_counter()
    try:
        return allocate(*a, **k)
    finally:
        kv[0] += time.perf_counter() - s
gpu_model_runner.allocate_kv_cache = timed
from contextlib import nullcontext
from orlhf.config.resolve import finish_config
from orlhf.cpu.engine_lean import vllm_start
from orlhf.cpu.tuning import CpuTuning
from orlhf.rollout.engine import EngineActor
from orlhf.rollout.engine_config import engine_config
flags = json.loads(sys.argv[1])
cfg = finish_config(flags, explicit=set(flags))
with vllm_start() if sys.argv[2] == "vllm_own" else nullcontext():
    t3 = time.perf_counter()
    EngineActor(engine_config(cfg), 0, tuning=CpuTuning.for_config(cfg))
    t4 = time.perf_counter()
print(json.dumps({"preload_s": t1 - t0, "import_vllm_s": t2 - t1, "llm_s": t4 - t3, "kv_alloc_s": kv[0],
                  "llm_without_kv_s": t4 - t3 - kv[0], "cpu_s": time.process_time()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model folder (default: the built-in demo's)")
    ap.add_argument("--repeats", type=int, default=3, help="starts per variant, alternating")
    ap.add_argument("--variants", default="orlhf,vllm_own", help="comma list of orlhf, vllm_own")
    a = ap.parse_args()
    flags: dict = {"device": "cpu", "enforce_eager": True, "prompt_max_len": 128, "generate_max_len": 24}
    if a.model:  # another model: finish_config then asks for prompts and a reward source (the demo's; not read)
        from orlhf.demo.builder import ensure_demo

        demo = ensure_demo()
        flags.update(pretrain=a.model, prompt_data=str(demo.prompts), remote_rm_url=str(demo.reward_fn))
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONPATH": str(ROOT)}
    env.setdefault("HF_HUB_OFFLINE", "1")
    rows: dict[str, list[dict]] = {v: [] for v in a.variants.split(",")}
    for i in range(a.repeats):
        for variant in rows:
            done = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(flags), variant], env=env, capture_output=True, text=True
            )
            if done.returncode != 0:
                sys.exit(f"{variant}: the engine did not start:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[variant].append(row)
            print(f"{i + 1} {variant:9s} " + " ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    summary = {v: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for v, rs in rows.items() if rs}
    print(json.dumps({"model": a.model or "demo", "load_avg": os.getloadavg(), "medians": summary}))


if __name__ == "__main__":
    main()
