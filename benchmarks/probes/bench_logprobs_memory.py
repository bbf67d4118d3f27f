"""Peak memory and time of the actor's log-prob part, chunked (--logprobs_chunk_mb, workers/lm_head.py) against the
whole (B, A, V) logits, on a random Llama with Qwen's 151,936-token vocabulary and a tiny body (hidden 64, 2
layers: the LM head and the softmax are what grow with length).

    for tokens in --tokens (response tokens of one micro-batch, one row), for mode in (whole, chunked):
        a fresh subprocess: build the model (seeded), then
          score   action_log_probs under no_grad (the reference / old-log-prob forward)
          train   action_log_probs_entropy with grad, loss = -(log p * advantage).mean(), backward (the actor's step)
        peak: CPU: the process's peak RSS above its RSS after building the model (ru_maxrss; each phase in its own
              process, so one phase's peak cannot hide another's); CUDA: torch.cuda.max_memory_allocated above the
              model's; time: the median of --repeats calls after one warm-up
    -> a table, and one JSON line: per (tokens, phase) the peaks, the ratio chunked / whole and the time ratio

Reproduce (CPU, ~2 min): PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_logprobs_memory.py
GPU: add --device cuda (bf16 with --bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VOCAB = 151_936


def build(device: str, bf16: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(device)
    return model.to(torch.bfloat16) if bf16 else model


def batch(tokens: int, device: str):
    import torch

    from orlhf.types import SequenceBatch

    prompt = 16
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, prompt + tokens), generator=g)
    mask = torch.ones_like(ids)
    return SequenceBatch(ids.to(device), mask.to(device), mask[:, prompt:].bool().to(device))


def peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def one(tokens: int, mode: str, phase: str, device: str, bf16: bool, repeats: int, chunk_mb: float) -> dict:
    """Runs in its own process: one (tokens, mode, phase)."""
    import torch

    from orlhf.workers.causal_lm import action_log_probs, action_log_probs_entropy

    model, b = build(device, bf16), batch(tokens, device)
    chunk = chunk_mb if mode == "chunked" else 0.0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = peak_bytes(device) if device == "cuda" else _rss()
    adv = torch.randn(1, tokens, device=device)

    def call():
        if phase == "score":
            with torch.no_grad():
                action_log_probs(model, b, 1.0, chunk_mb=chunk)
            return
        lp, _ = action_log_probs_entropy(model, b, 1.0, chunk_mb=chunk)
        (-(lp * adv).mean()).backward()
        model.zero_grad(set_to_none=True)

    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return {"peak_mib": (peak_bytes(device) - base) / 2**20, "seconds": statistics.median(times)}


def _available() -> int:
    """MemAvailable of this machine, bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,4096,16384", help="response tokens per micro-batch, comma list")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk_mb", type=float, default=256.0, help="--logprobs_chunk_mb of the chunked mode")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: tokens,mode,phase in this process
    a = ap.parse_args()
    if a.one:
        tokens, mode, phase = a.one.split(",")
        print(json.dumps(one(int(tokens), mode, phase, a.device, a.bf16, a.repeats, a.chunk_mb)))
        return
    rows = []
    for tokens in [int(t) for t in a.tokens.split(",")]:
        for phase in ("score", "train"):
            got = {}
            for mode in ("whole", "chunked"):
                need = tokens * VOCAB * 4 * (4 if phase == "train" else 2) if mode == "whole" else 0
                if a.device == "cpu" and need > 0.6 * _available():  # the OOM killer could take another process
                    got[mode] = {
                        "peak_mib": float("nan"),
                        "seconds": float("nan"),
                        "skipped": f"needs ~{need / 2**30:.0f} GiB",
                    }
                    continue
                cmd = [sys.executable, __file__, "--one", f"{tokens},{mode},{phase}", "--device", a.device]
                cmd += ["--repeats", str(a.repeats), "--chunk_mb", str(a.chunk_mb)] + (["--bf16"] if a.bf16 else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                got[mode] = json.loads(out)
            w, c = got["whole"], got["chunked"]
            rows.append(
                {
                    "tokens": tokens,
                    "phase": phase,
                    "whole_mib": round(w["peak_mib"], 1),
                    "chunked_mib": round(c["peak_mib"], 1),
                    "memory_ratio": round(c["peak_mib"] / w["peak_mib"], 4) if w["peak_mib"] > 0 else None,
                    "whole_skipped": w.get("skipped"),
                    "whole_s": round(w["seconds"], 4),
                    "chunked_s": round(c["seconds"], 4),
                    "time_ratio": round(c["seconds"] / w["seconds"], 3),
                }
            )
            r = rows[-1]
            print(
                f"{tokens:>6} {phase:<5} whole {r['whole_mib']:>9.1f} MiB {r['whole_s']:>8.3f} s | chunked "
                f"{r['chunked_mib']:>8.1f} MiB {r['chunked_s']:>8.3f} s | memory x{r['memory_ratio']} time "
                f"x{r['time_ratio']}",
                flush=True,
            )
    print(json.dumps({"device": a.device, "bf16": a.bf16, "vocab": VOCAB, "chunk_mb": a.chunk_mb, "rows": rows}))


if __name__ == "__main__":
    main()
