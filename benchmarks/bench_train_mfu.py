"""The actor's train step on one GPU: tokens/s, MFU, peak memory against `orlhf plan`, and the top kernels.

    per size (a random Llama built from its sizes with the demo's tokenizer: model_presets.build_model) and
    micro-batch, one child process (an OOM or the allocator's state never carries over to the next):
        flags (--pretrain that model, bf16 on cuda, one actor rank: ZeRO-2 unless --set zero_stage=N)
        -> finish_config -> worker_config("actor") -> PolicyWorker.init()   (world size 1, no Ray)
        -> micro_batch x --accum rows of --seq_len random tokens, no padding (the last seq_len - prompt_len
           columns are the response; single pass: pi_old is the step's own forward, as GRPO's)
        -> --warmup steps, --steps timed steps (synchronised), then one step under the torch profiler
        -> tokens/s; MFU = 6 x params x tokens / step seconds / the GPU's dense bf16 peak (6PT counts the
           weights' matmuls forward and backward; attention's score and value products are left out)
        -> torch.cuda.max_memory_allocated over init and the steps, against plan_memory.role_memory for the
           same config (model states + reduce bucket; activations come on top)
        -> the profiler's top 10 CUDA kernels by total time in the profiled step, and the kernels' share of it
    --micro_batch max: doubles the micro-batch from --start_micro_batch until CUDA runs out of memory; every size
    that ran is a row, the largest marked. Ends with one JSON line.

On CPU (--device cpu --sizes tiny) the same path runs in fp32 and takes seconds: MFU and the CUDA peak are null
there, and the top ops by CPU time stand in for kernels (what tests/unit/test_bench_train_mfu.py runs).
--set KEY=VALUE passes any train-ppo flag (gradient_checkpointing=true, packing_samples=true, zero_stage=3) to
both the worker and the plan; --peak_tflops sets the peak of a GPU the table does not know.

    python benchmarks/bench_train_mfu.py --sizes 0.4b,1b --micro_batch 8 --seq_len 1024
    python benchmarks/bench_train_mfu.py --sizes 1b --micro_batch max --seq_len 1024
    python benchmarks/bench_train_mfu.py --device cpu --sizes tiny --micro_batch 2 --seq_len 32 --steps 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (hidden, layers); intermediate 2 x hidden and 64-dim heads (model_presets.build_model's defaults)
SIZES = {"tiny": (64, 2), "0.4b": (1536, 16), "1b": (2048, 24)}
# Dense bf16 tensor-core peaks, TFLOP/s, by a substring test on torch.cuda.get_device_name(): (needles, peak).
# "H100 80GB HBM3" is the SXM part's name; the PCIe and NVL parts have lower peaks and are not in the table.
GPU_PEAKS = ((("H200",), 989.0), (("H100", "SXM"), 989.0), (("H100", "HBM3"), 989.0), (("A100",), 312.0))
RESULT = "BENCH_TRAIN_MFU_RESULT "  # the child's result line
REPORT_KEYS = ("size", "params", "micro_batch", "seq_len", "step_s", "tokens_per_s", "mfu", "peak_alloc_mib")
REPORT_KEYS += ("plan_mib", "peak_over_plan", "kernel_share", "oom", "error")


def gpu_peak_tflops(name: str) -> Optional[float]:
    """The dense bf16 peak of the GPU called `name`, None when the table does not know it."""
    for needles, peak in GPU_PEAKS:
        if all(n in name for n in needles):
            return peak
    return None


def mfu(params: int, tokens: int, seconds: float, peak_tflops: Optional[float]) -> Optional[float]:
    """6 x params x tokens / seconds as a share of the peak; None without a peak."""
    if not peak_tflops or seconds <= 0:
        return None
    return 6 * params * tokens / seconds / (peak_tflops * 1e12)


def top_kernels(events: list[tuple], n: int = 10) -> list[dict]:
    """(name, microseconds[, calls]) per kernel launch or per profiler row -> the n names with the most total time:
    name, calls, total ms and the share of all the time listed."""
    total: dict[str, list] = {}
    for name, us, *calls in events:
        row = total.setdefault(name, [0, 0.0])
        row[0] += calls[0] if calls else 1
        row[1] += us
    whole = sum(us for _, us in total.values()) or 1.0
    ranked = sorted(total.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": k, "calls": c, "total_ms": us / 1e3, "share": us / whole} for k, (c, us) in ranked]


def doubling(start: int, limit: int, run: Callable[[int], dict]) -> list[dict]:
    """run(start), run(2 x start), ... until a run reports {"oom": True} (or fails: "error") or the micro-batch
    would pass `limit`. Returns every run's row; the largest that fit carries "largest_fit": True."""
    rows, mb = [], start
    while mb <= limit:
        row = run(mb)
        rows.append(row)
        if row.get("oom") or row.get("error"):
            break
        mb *= 2
    fit = [r for r in rows if not (r.get("oom") or r.get("error"))]
    if fit:
        fit[-1]["largest_fit"] = True
    return rows


def parse_sizes(spec: str) -> list[tuple[str, int, int]]:
    """'0.4b,1b' or '1024x8' (hidden x layers) -> [(name, hidden, layers)]; ValueError naming a bad entry."""
    out = []
    for s in (x.strip() for x in spec.split(",") if x.strip()):
        if s in SIZES:
            out.append((s, *SIZES[s]))
            continue
        h, _, n = s.partition("x")
        if not (h.isdigit() and n.isdigit()):
            raise ValueError(f"--sizes {s!r}: use {', '.join(SIZES)} or HIDDENxLAYERS (e.g. 1024x8)")
        out.append((s, int(h), int(n)))
    if not out:
        raise ValueError("--sizes is empty: use " + ", ".join(SIZES) + " or HIDDENxLAYERS")
    return out


def parse_sets(items: list[str]) -> dict:
    """['zero_stage=3', 'packing_samples=true'] -> {'zero_stage': 3, 'packing_samples': True} (JSON values, else
    strings); ValueError naming an entry without "="."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--set {item!r}: use KEY=VALUE with a train-ppo flag name (e.g. zero_stage=3)")
        try:
            out[key.lstrip("-")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.lstrip("-")] = value
    return out


# ---- the child: one size, one micro-batch ---------------------------------------------------------------------


def _flags(spec: dict, model: str, save: str) -> dict:
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()  # its prompts and reward only satisfy validation: the step reads neither
    rows = spec["micro_batch"] * spec["accum"]
    return {
        "pretrain": model,
        "prompt_data": str(demo.prompts),
        "remote_rm_url": str(demo.reward_fn),
        "save_path": save,
        "device": spec["device"],
        "bf16": spec["bf16"],
        "advantage_estimator": "reinforce",
        "n_samples_per_prompt": 1,
        "rollout_batch_size": rows,
        "train_batch_size": rows,
        "micro_train_batch_size": spec["micro_batch"],
        "micro_rollout_batch_size": spec["micro_batch"],
        "prompt_max_len": spec["prompt_len"],
        "generate_max_len": spec["seq_len"] - spec["prompt_len"],
        "actor_learning_rate": 1e-6,
        **spec["sets"],
    }


def _batch(rows: int, seq_len: int, prompt_len: int, vocab: int):
    import torch

    from orlhf.types import Experience

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(4, vocab, (rows, seq_len), generator=g)
    attn = torch.ones(rows, seq_len, dtype=torch.long)
    act = torch.ones(rows, seq_len - prompt_len, dtype=torch.bool)
    adv = torch.randn(rows, 1, generator=g).expand_as(act).contiguous()
    return Experience(seq, attn, act, action_log_probs=None, advantages=adv)


def _profiled_step(worker, exp, cuda: bool) -> tuple[list[dict], Optional[float], float]:
    """One step under the profiler: (top 10 kernels, or CPU ops on cpu; kernels' share of the step; seconds)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        worker.train_step(exp)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    if not cuda:  # CPU ops by self CPU time: no kernels to list
        ops = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
        return top_kernels(ops), None, seconds
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:  # a profiler build without device events: ops by the device time of their own kernels
        kernels = [(e.key, e.self_device_time_total, e.count) for e in prof.key_averages() if e.self_device_time_total]
    return top_kernels(kernels), sum(k[1] for k in kernels) / 1e6 / seconds, seconds


def child(spec: dict) -> dict:
    """Build, measure and return one row (or {"oom": True, ...} when CUDA ran out of memory)."""
    import torch

    cuda = spec["device"] == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here; run with --device cpu (e.g. --sizes tiny)")
    try:
        return _measure(spec, cuda)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # DeepSpeed re-raises some CUDA OOMs as RuntimeError
        if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
            raise
        return {"size": spec["size"], "micro_batch": spec["micro_batch"], "oom": True, "error_text": str(e)[:300]}


def _measure(spec: dict, cuda: bool) -> dict:
    import resource
    import tempfile

    import torch
    from model_presets import bench_cache, build_model

    from orlhf.config.resolve import finish_config
    from orlhf.config.worker_config import worker_config
    from orlhf.launch.plan_memory import GIB, count_params, read_dims, role_memory
    from orlhf.workers import PolicyWorker

    path = build_model(
        Path(spec["cache"]) if spec["cache"] else bench_cache(),
        spec["hidden"],
        spec["layers"],
        spec["seq_len"],
        init_device=spec["device"],
    )
    if cuda:
        torch.cuda.empty_cache()  # a model built here leaves its blocks cached: give them back before measuring
    flags = _flags(spec, str(path), tempfile.mkdtemp(prefix="bench_mfu_"))
    cfg = finish_config(flags, frozenset(flags))
    steps = spec["warmup"] + spec["steps"] + 1
    wcfg = worker_config(cfg, "actor", steps)
    dims = read_dims(path)
    plan = role_memory(cfg, "actor", count_params(dims), 1, device=cfg.device)
    exp = _batch(spec["micro_batch"] * spec["accum"], spec["seq_len"], spec["prompt_len"], dims.vocab)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    worker = PolicyWorker(wcfg)
    worker.init()
    params = sum(p.numel() for p in worker.engine.module.parameters())
    for _ in range(spec["warmup"]):
        worker.train_step(exp)
    times = []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        stats = worker.train_step(exp)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    kernels, kernel_share, prof_s = _profiled_step(worker, exp, cuda) if spec["profile"] else ([], None, None)
    step_s = statistics.median(times)
    tokens = exp.sequences.numel()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    peak_tflops = (spec["peak_tflops"] or gpu_peak_tflops(gpu)) if cuda else None
    return {
        "size": spec["size"],
        "gpu": gpu,
        "peak_tflops": peak_tflops,
        "hidden": spec["hidden"],
        "layers": spec["layers"],
        "params": params,
        "plan_params": count_params(dims),
        "micro_batch": spec["micro_batch"],
        "accum": spec["accum"],
        "seq_len": spec["seq_len"],
        "tokens_per_step": tokens,
        "dtype": "bf16" if spec["bf16"] else "fp32",
        "zero_stage": wcfg.zero_stage,
        "step_s": step_s,
        "step_s_all": [round(x, 4) for x in times],
        "tokens_per_s": tokens / step_s,
        "model_tflops": 6 * params * tokens / step_s / 1e12,
        "mfu": mfu(params, tokens, step_s, peak_tflops) if spec["bf16"] else None,
        "peak_alloc_mib": peak / 2**20 if peak is not None else None,
        "plan_mib": plan.device_gib * GIB / 2**20,
        "plan_formula": plan.formula,
        "peak_over_plan": peak / (plan.device_gib * GIB) if peak is not None and plan.device_gib else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "profiled_step_s": prof_s,
        "kernel_share": kernel_share,
        "top_kernels": kernels,
        "loss": stats.loss,
        "oom": False,
    }


# ---- the parent: one child per size and micro-batch ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(spec: dict, timeout_s: float) -> dict:
    env = dict(
        os.environ,
        DS_ACCELERATOR=spec["device"],
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"size": spec["size"], "micro_batch": spec["micro_batch"], "error": f"timed out after {timeout_s} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT) :])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    print("\n".join(tail), file=sys.stderr)
    return {"size": spec["size"], "micro_batch": spec["micro_batch"], "error": f"exit {proc.returncode}"}


def mfu_note(device: str, gpu: Optional[str], peak: Optional[float], bf16: bool) -> str:
    """What the MFU column is measured against, or why it is null."""
    if device == "cpu":
        return "cpu: MFU null (no peak for a CPU), no CUDA peak memory; top_kernels are CPU ops by self time"
    if not bf16:
        return "fp32: MFU null (the table holds bf16 peaks)"
    if peak is None:
        return f"MFU null: no dense bf16 peak known for {gpu!r} (pass --peak_tflops)"
    return f"MFU against {peak:g} TFLOP/s dense bf16 ({gpu})"


def _row_text(r: dict) -> str:
    if r.get("oom"):
        return f"{r['size']:>6} mb {r['micro_batch']:>4}: CUDA out of memory"
    if "params" not in r:
        return f"{r['size']:>6} mb {r['micro_batch']:>4}: failed ({r.get('error')})"
    m = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    peak = "n/a" if r["peak_alloc_mib"] is None else f"{r['peak_alloc_mib']:.0f} MiB"
    ratio = "" if r["peak_over_plan"] is None else f" ({r['peak_over_plan']:.2f}x plan)"
    return (
        f"{r['size']:>6} {r['params'] / 1e6:8.1f}M mb {r['micro_batch']:>4} x {r['seq_len']} tok: "
        f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tok/s, {r['model_tflops']:.1f} TFLOP/s, MFU {m}, "
        f"peak {peak}{ratio}, plan {r['plan_mib']:.0f} MiB" + (" <- largest fit" if r.get("largest_fit") else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sizes", default="0.4b,1b", help=f"{', '.join(SIZES)} or HIDDENxLAYERS, comma-separated")
    ap.add_argument("--micro_batch", default="8", help="rows per micro-batch, or 'max' (doubling until CUDA OOM)")
    ap.add_argument("--start_micro_batch", type=int, default=1, help="--micro_batch max: the first size tried")
    ap.add_argument("--max_micro_batch", type=int, default=1024, help="--micro_batch max: stop doubling past it")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--seq_len", type=int, default=1024, help="tokens per row (prompt + response)")
    ap.add_argument("--prompt_len", type=int, default=0, help="prompt tokens per row (default: a quarter)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no_profile", action="store_true", help="skip the profiled step")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 on cuda (MFU is then null: no fp32 peak)")
    ap.add_argument("--peak_tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in the table")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any train-ppo flag")
    ap.add_argument("--cache", default=None, help="model folder (default: <orlhf cache>/bench)")
    ap.add_argument("--timeout_s", type=float, default=900, help="per child process")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(RESULT + json.dumps(child(json.loads(a.child))), flush=True)
        return
    try:
        sizes, sets = parse_sizes(a.sizes), parse_sets(a.set)
    except ValueError as e:
        ap.error(str(e))  # exit 2
    find_max = a.micro_batch == "max"
    if not find_max and not (a.micro_batch.isdigit() and int(a.micro_batch) > 0):
        ap.error(f"--micro_batch {a.micro_batch!r}: a positive number, or 'max'")
    if find_max and a.device != "cuda":
        ap.error("--micro_batch max needs --device cuda (it doubles until CUDA runs out of memory)")
    if min(a.steps, a.accum, a.start_micro_batch) < 1 or a.warmup < 0:
        ap.error("--steps, --accum and --start_micro_batch must be >= 1, --warmup >= 0")
    prompt_len = a.prompt_len or a.seq_len // 4
    if not 0 < prompt_len < a.seq_len:
        ap.error(f"--prompt_len {prompt_len}: between 1 and --seq_len - 1 ({a.seq_len - 1})")
    bf16 = a.device == "cuda" and not a.fp32
    base = dict(
        device=a.device,
        bf16=bf16,
        accum=a.accum,
        seq_len=a.seq_len,
        prompt_len=prompt_len,
        warmup=a.warmup,
        steps=a.steps,
        profile=not a.no_profile,
        peak_tflops=a.peak_tflops,
        sets=sets,
        cache=a.cache,
    )
    results = []
    for size, hidden, layers in sizes:

        def one(mb: int, size=size, hidden=hidden, layers=layers) -> dict:
            row = run_child({**base, "size": size, "hidden": hidden, "layers": layers, "micro_batch": mb}, a.timeout_s)
            print(_row_text(row), flush=True)
            return row

        if find_max:
            results += doubling(a.start_micro_batch, a.max_micro_batch, one)
        else:
            results.append(one(int(a.micro_batch)))
    for r in results:
        for k in r.get("top_kernels") or []:
            head = f"  {r['size']} mb {r['micro_batch']}: {k['total_ms']:9.2f} ms {100 * k['share']:5.1f}%"
            print(f"{head}  {k['name'][:90]}")
    ran = [r for r in results if "params" in r]
    name, peak = (ran[0]["gpu"], ran[0]["peak_tflops"]) if ran else (None, a.peak_tflops)
    note = mfu_note(a.device, name, peak, bf16)
    print(f"[bench_train_mfu] {note}", flush=True)
    out = {"device": a.device, "gpu": name, "peak_tflops": peak, "note": note, "sets": sets, "results": results}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if os.environ.get("ORLHF_GPU_REPORT"):  # scripts/gpu_check.sh's list of measured figures: a line per row
        with open(os.environ["ORLHF_GPU_REPORT"], "a") as f:
            for r in results:
                f.write(json.dumps({"test": "train_mfu", **{k: r.get(k) for k in REPORT_KEYS if k in r}}) + "\n")
    print(json.dumps(out))
    if any(r.get("error") or (r.get("oom") and not find_max) for r in results):
        sys.exit(1)  # a failed child, or an OOM at the micro-batch asked for


if __name__ == "__main__":
    main()
