"""How much slower bf16 is than fp32 on this CPU: the probe behind --bf16's refusal on CPUs without bf16
instructions (orlhf/cpu/bf16.py). Results: benchmarks/results/2026-12-02-cpu-bf16-slowdown.md.

    cpu       the model name, the flags that decide (avx512_bf16, amx_bf16; Arm's bf16) and their neighbours, torch's
              CPU capability, the load average before and after
    matmul    (rows, k) @ (k, n) in fp32 and in bf16, interleaved, best and median of --repeats: the refusal's own
              timing (64x576 @ 576x576) and a SmolLM2-135M MLP up-projection of 256 tokens (256x576 @ 576x1536)
    llama     a forward + backward of a causal LM on --batch x --seq random tokens, the model cast to each dtype
              (as --bf16 casts the trained weights): the built-in demo (2 layers, hidden 128) and a random Llama
              shaped like SmolLM2-135M but 9 layers (hidden 576, intermediate 1536, 9 heads, 3 KV heads, vocabulary
              49,152, tied embeddings)
    -> a table (seconds, bf16 / fp32), and one final JSON line

Reproduce (~2 min on a 2-core AVX2 CPU, most of it the bf16 passes):
    .venv/bin/python benchmarks/probes/bench_cpu_bf16.py
    .venv/bin/python benchmarks/probes/bench_cpu_bf16.py --threads 2 --repeats 5
On a machine shared with other jobs only the ratios inside one run mean anything (the dtypes are interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FLAGS_SHOWN = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "bf16", "f16c")


def timed(fns: dict, repeats: int) -> dict:
    """{name: {"best_s", "median_s"}} of each fn run `repeats` times, interleaved, after one warm-up each."""
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i:
                runs[name].append(time.perf_counter() - t0)
    return {name: {"best_s": min(r), "median_s": statistics.median(r)} for name, r in runs.items()}


def with_ratio(times: dict) -> dict:
    """`times` and bf16 / fp32 of the medians and of the bests (on a shared machine the bests are steadier)."""
    ratio = {f"bf16_over_fp32_{k}": times["bf16"][f"{k}_s"] / times["fp32"][f"{k}_s"] for k in ("median", "best")}
    return times | ratio


def matmuls(repeats: int) -> dict:
    import torch

    out = {}
    for rows, k, n in ((64, 576, 576), (256, 576, 1536)):
        a, b = torch.randn(rows, k), torch.randn(k, n)
        pairs = {"fp32": (a, b), "bf16": (a.bfloat16(), b.bfloat16())}
        out[f"{rows}x{k}@{k}x{n}"] = with_ratio(timed({d: lambda p=p: p[0] @ p[1] for d, p in pairs.items()}, repeats))
    return out


def models() -> dict:
    from transformers import AutoConfig, LlamaConfig

    from orlhf.demo.builder import ensure_demo

    smol9 = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=9,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return {"demo": AutoConfig.from_pretrained(ensure_demo().model), "smollm2_shape_9_layers": smol9}


def forward_backward(config, batch: int, seq: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(3, config.vocab_size, (batch, seq))
    nets = {"fp32": base, "bf16": AutoModelForCausalLM.from_config(config, dtype=torch.float32)}
    nets["bf16"].load_state_dict(base.state_dict())
    nets["bf16"].to(torch.bfloat16)

    def step(net):
        net(input_ids=ids, labels=ids).loss.backward()
        net.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in base.parameters())
    return with_ratio(timed({d: lambda n=n: step(n) for d, n in nets.items()}, repeats)) | {"params": params}


def cpu() -> dict:
    import torch

    from orlhf.cpu.bf16 import cpu_info

    info = cpu_info()
    flags = sorted(f for f in FLAGS_SHOWN if info and f in info.flags)
    return {
        "model": info.model if info else None,
        "flags": flags,
        "native_bf16": info.native_bf16 if info else None,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rank's compute thread: 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    result = {"cpu": cpu(), "threads": a.threads, "load_avg_before": os.getloadavg(), "command": sys.argv}
    result["matmul"] = matmuls(a.repeats)
    shape = f"fwd+bwd {a.batch}x{a.seq}"
    result["llama"] = {
        f"{name} {shape}": forward_backward(c, a.batch, a.seq, a.repeats) for name, c in models().items()
    }
    result["load_avg_after"] = os.getloadavg()
    print(f"{result['cpu']['model']}, flags {' '.join(result['cpu']['flags'])}, {a.threads} thread(s)")
    print(f"{'work (median s; best s)':<38}{'fp32':>18}{'bf16':>18}{'bf16/fp32':>11}{'of bests':>10}")
    for name, r in {**result["matmul"], **result["llama"]}.items():
        fp32, bf16 = (f"{r[d]['median_s']:.4f}; {r[d]['best_s']:.4f}" for d in ("fp32", "bf16"))
        ratios = f"{r['bf16_over_fp32_median']:>10.1f}x{r['bf16_over_fp32_best']:>9.1f}x"
        print(f"{name:<38}{fp32:>18}{bf16:>18}{ratios}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
