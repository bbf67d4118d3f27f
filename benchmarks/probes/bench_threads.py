"""Torch threads on the demo model's per-phase work: 1 against 2 threads, and where a 1-thread process spends its
time (with py-spy). Results:
benchmarks/results/2026-11-22-cpu-threads.md.

    threads   one process, interleaved rounds: for 1 and 2 threads, the actor's train micro-batch (HF forward +
              backward, 64 x 40 tokens), a step's scoring forward (256 x 40), 24 decode forwards of 256 rows;
              seconds (median of rounds), CPU seconds per wall second, the 2-thread speed-up; then the CPU an idle
              process burns in the second after a 2-thread region (OpenMP spinning)
    profile   --pyspy PATH: a child does one phase's work in a loop (generate: in-process vLLM as orlhf's engine,
              64 prompts x 4 samples x 24 tokens with log-probs; train: the HF micro-batch above), 1 thread;
              py-spy --native attaches once it is warm; samples are grouped by their leaf frame (math kernels,
              Python code, torch dispatch, libc, Python GC, libgomp)
    -> a table, and one final JSON line

Reproduce (2-core CPU; ~1 min for threads, ~2 min with --pyspy; py-spy from the package registry, outside the
project's virtualenv: `pip install --target /tmp/pyspy py-spy`):
    .venv/bin/python benchmarks/probes/bench_threads.py
    .venv/bin/python benchmarks/probes/bench_threads.py --pyspy /tmp/pyspy/bin/py-spy
On a machine shared with other jobs only the shares and the ratios inside one run mean anything.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

KERNEL = re.compile(
    r"mkl_|gemm|VectorizedLoop|_mm512|_mm256|Sleef|softmax|flash_attention|cpu_attention|serial_vec|"
    r"vectorized|serial_for_each|DimCounter|\bexp\b|libm\.so|reduce|cpu_kernel|copy_kernel|fill|"
    r"rsqrt|pow|mul|add_|index_select|embedding|gather|scatter|topk|sort|argmax|multinomial|cumsum",
    re.I,
)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def workloads():
    import torch
    from transformers import AutoModelForCausalLM

    from orlhf.demo.builder import ensure_demo

    model = AutoModelForCausalLM.from_pretrained(ensure_demo().model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    v = model.config.vocab_size
    train, score, decode = (torch.randint(3, v, shape, generator=g) for shape in ((64, 40), (256, 40), (256, 1)))

    def train_mb():
        model(input_ids=train, labels=train).loss.backward()
        model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def score_step():
        model(input_ids=score)

    @torch.no_grad()
    def decode_24():
        for _ in range(24):
            model(input_ids=decode)

    return {"train_mb64": train_mb, "score_256": score_step, "decode24_256": decode_24}


def measure_threads(rounds: int) -> dict:
    import torch

    work = workloads()
    seen: dict = collections.defaultdict(list)
    for _ in range(rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, fn in work.items():
                fn()
                c0, t0 = cpu_s(), time.perf_counter()
                for _ in range(3):
                    fn()
                wall = time.perf_counter() - t0
                seen[(name, threads)].append((wall / 3, (cpu_s() - c0) / wall))
    out = {}
    for name in work:
        one, two = (statistics.median(w for w, _ in seen[(name, t)]) for t in (1, 2))
        out[name] = {
            "s_1_thread": one,
            "s_2_threads": two,
            "speedup_2_threads": one / two,
            "cpu_per_wall_2_threads": statistics.median(u for _, u in seen[(name, 2)]),
        }
    torch.set_num_threads(2)
    work["score_256"]()
    c0 = cpu_s()
    time.sleep(1.0)
    out["idle_cpu_s_in_1s_after_2_thread_region"] = cpu_s() - c0
    return out


def child(phase: str) -> None:
    """Run one phase's work forever (the parent attaches py-spy and kills it); print START once warm."""
    import torch

    torch.set_num_threads(1)
    if phase == "train":
        fn = workloads()["train_mb64"]
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from orlhf.demo.builder import ensure_demo

        llm = LLM(
            model=str(ensure_demo().model), enforce_eager=True, dtype="float32", seed=0, kv_cache_memory_bytes=2**30
        )
        g = torch.Generator().manual_seed(0)
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 900, (16,), generator=g).tolist()) for _ in range(64)]
        sampling = SamplingParams(n=4, temperature=1.0, max_tokens=24, min_tokens=24, logprobs=0, detokenize=False)

        def fn():
            llm.generate(prompts, sampling, use_tqdm=False)

    fn()
    print("START", flush=True)
    while True:
        fn()


def profile(pyspy: str, phase: str, seconds: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, __file__, "--child", phase], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.startswith("START"):
                break
        raw = out / f"pyspy_{phase}.txt"
        subprocess.run(
            [
                pyspy,
                "record",
                "--native",
                "-r",
                "100",
                "-f",
                "raw",
                "-d",
                str(seconds),
                "-p",
                str(proc.pid),
                "-o",
                str(raw),
            ],
            check=True,
            capture_output=True,
        )
    finally:
        proc.kill()
        proc.wait()
    return categorize(raw)


def categorize(raw: Path) -> dict:
    shares: collections.Counter = collections.Counter()
    for line in open(raw):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        if "gc_collect" in leaf:
            what = "python GC"
        elif ".py:" in leaf or ".py)" in leaf:
            what = "python code"
        elif "libc.so" in leaf or leaf.startswith(("brk", "free", "malloc", "memcpy", "memset")):
            what = "libc memcpy/malloc"
        elif "gomp" in leaf.lower():
            what = "libgomp"
        elif KERNEL.search(leaf):
            what = "math kernels"
        elif "libpython" in leaf or "_Py" in leaf:
            what = "python interpreter"
        else:
            what = "torch dispatch / bookkeeping"
        shares[what] += int(n)
    total = sum(shares.values()) or 1
    return {k: v / total for k, v in shares.most_common()} | {"samples": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pyspy", help="path of a py-spy binary: also profile a 1-thread generate and train phase")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_threads")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"threads": measure_threads(a.rounds), "load_avg": os.getloadavg(), "cores": os.cpu_count()}
    print(f"{'work':<14}{'1 thread s':>12}{'2 threads s':>13}{'speed-up':>10}")
    for name, r in result["threads"].items():
        if isinstance(r, dict):
            print(f"{name:<14}{r['s_1_thread']:>12.4f}{r['s_2_threads']:>13.4f}{r['speedup_2_threads']:>9.2f}x")
    if a.pyspy:
        result["profile"] = {phase: profile(a.pyspy, phase, a.seconds, a.out) for phase in ("generate", "train")}
        for phase, shares in result["profile"].items():
            print(f"{phase}: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items() if k != "samples"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
