"""This machine's CPU and its measured fp32 matrix-product rate: the roofline each phase's FLOP rate is read against.

cpu_facts()                  lscpu's model name and flags, and the instruction sets that decide the kernels
                             (avx2, avx512f, avx512_bf16, amx_bf16): what every result file and JSON records
fp32_matmul_rate(threads)    GFLOP/s of torch.mm on 2048 x 2048 fp32 squares with `threads` torch threads, the
                             best of a few, measured in a fresh process (the rate a phase could reach at most:
                             its products are smaller and its other ops slower)
phase_rates(flop, seconds, roof)  per phase: GFLOP, seconds, GFLOP/s and the share of the roofline
mode_rates(prof, mode, phases, roof)  phase_rates of one trl_compare mode, its FLOPs from flop_profile.profile:
                             TRL's one generate_score phase; the modes that generate with HF generate (TRL,
                             orlhf_trainer, hybrid) over the padded batch, the others with vLLM

PYTHONPATH=$PWD .venv/bin/python benchmarks/roofline.py --threads 2     # prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))  # flop_profile.py

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")

_MM = r"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
n, best = 2048, 0.0
a, b = torch.randn(n, n), torch.randn(n, n)
torch.mm(a, b)
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    for _ in range(4):
        torch.mm(a, b)
    best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t) / 1e9)
print(best)
"""


def cpu_facts() -> dict:
    """{"model", "flags" (lscpu's, space-separated), "kernel_flags" (those of KERNEL_FLAGS present), "cores"}; the
    model from /proc/cpuinfo where lscpu is missing."""
    info: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}
    except (OSError, subprocess.SubprocessError):
        pass
    model, flags = info.get("Model name", ""), info.get("Flags", "")
    if not flags and os.path.exists("/proc/cpuinfo"):
        text = open("/proc/cpuinfo").read()
        pick = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
        model, flags = model or pick.get("model name", ""), pick.get("flags", "")
    have = set(flags.split())
    return {
        "model": model,
        "flags": flags,
        "kernel_flags": [f for f in KERNEL_FLAGS if f in have],
        "cores": os.cpu_count(),
        # set to run a narrower instruction set than the CPU has (torch's own kernels, oneDNN, MKL): the flags above
        # are then the CPU's, not what the kernels used (vLLM-CPU's attention kernels do not read these)
        "isa_limits": {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)},
    }


ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def fp32_matmul_rate(threads: int, repeats: int = 5) -> float:
    """GFLOP/s of fp32 torch.mm (2048 squares) with `threads` torch threads: the best of `repeats` rounds, in a fresh
    process (so the caller's threads and allocations do not count)."""
    done = subprocess.run(
        [sys.executable, "-c", _MM, str(threads), str(repeats)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"the matrix-product probe failed: {done.stderr.strip()[-500:]}")
    return round(float(done.stdout.strip().splitlines()[-1]), 1)


def phase_rates(flop: dict[str, float], seconds: dict[str, float], roof: float) -> dict[str, dict]:
    """{phase: {"gflop", "s", "gflop_s", "of_roofline"}} for each phase with both a FLOP count and a time."""
    out = {}
    for phase, f in flop.items():
        s = seconds.get(phase)
        if not s:
            continue
        rate = f / 1e9 / s
        out[phase] = {
            "gflop": round(f / 1e9, 1),
            "s": round(s, 2),
            "gflop_s": round(rate, 1),
            "of_roofline": round(rate / roof, 3) if roof else None,
        }
    return out


HF_GENERATE = ("trl", "orlhf_trainer", "hybrid")  # trl_compare's modes that generate with HF generate


def mode_rates(prof: dict, mode: str, phases: dict[str, float], roof: float) -> dict[str, dict]:
    """phase_rates of trl_compare `mode` from its median seconds per phase and flop_profile.profile's FLOPs (prof:
    {"orlhf": {...}, "trl": {...}})."""
    side = prof["trl"] if mode == "trl" else prof["orlhf"]
    flop = {p: side[p] for p in ("generate", "score", "train")}
    if mode in HF_GENERATE:
        flop["generate"] = prof["trl"]["generate"]
    flop["generate_score"] = flop["generate"] + flop["score"]
    return phase_rates(flop, phases, roof)


def prompt_ids(model: str, prompts_file: str, key: str, count: int, template: bool) -> list[list[int]]:
    """The first `count` prompts' token ids as both sides give them (the model's chat template where `template`)."""
    if template:
        from flop_profile import templated

        return templated(model, prompts_file, key, count)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(json.loads(line)[key])["input_ids"] for line, _ in zip(open(prompts_file), range(count))]


def add_mode_rates(result: dict, model: str, prompts: list[list[int]], work: dict, roof: float) -> None:
    """result[mode]["rates"] = mode_rates(...) for each trl_compare mode with phases; FLOPs counted for the mean
    response length orlhf's runs logged (the limit where none did). work: samples_per_prompt, micro_batch,
    new_tokens."""
    from flop_profile import Shape, profile
    from transformers import AutoConfig

    lengths = [r["response_length"] for r in result.values() if r.get("response_length")]
    resp = lengths[0] if lengths else float(work["new_tokens"])
    shape = Shape.of(AutoConfig.from_pretrained(model))
    prof = profile(shape, prompts, work["samples_per_prompt"], work["micro_batch"], resp, work["new_tokens"])
    for mode, r in result.items():
        if "phases" in r:
            r["rates"] = mode_rates(prof, mode, r["phases"], roof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    rate = fp32_matmul_rate(a.threads)
    print(json.dumps({"cpu": cpu_facts(), "threads": a.threads, "fp32_mm_gflop_s": rate, "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
