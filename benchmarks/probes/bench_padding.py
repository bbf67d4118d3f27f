"""Padding removal on one model worker: padded vs trimmed vs packed micro-batches, same batch, same results.

    one process, world size 1, ZeRO-3 (the workers' real code path: DeepSpeed engine, micro-batching)
    a batch whose prompt and response lengths spread uniformly (--prompt_len lo hi, --response_len lo hi), padded
    to the longest of each as the controller sends it
    for layout in (padded = --no_trim_padding, trimmed = the default, packed = --packing_samples):
        actor log_probs (scoring) and train_step (PPO, one optimizer step), --repeats timed after one warm-up
    -> seconds per call, speed-up against padded, real-token share of the padded batch, max |diff| of the
       log-probs against padded (on real tokens), and one JSON line

The PPO demo's own data barely pad (prompts of 7-15 tokens, responses that run to the limit), so
ppo_throughput.py's `+padded` knob shows little there; this isolates the effect where lengths spread, as with
real prompts and EOS-terminated responses.

Reproduce (2-core CPU, ~1 min):
    .venv/bin/python benchmarks/probes/bench_padding.py
    .venv/bin/python benchmarks/probes/bench_padding.py --hidden 512 --layers 4 --response_len 16 512
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # model_presets
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYOUTS = {"padded": {"trim_padding": False}, "trimmed": {}, "packed": {"packing_samples": True}}


def make_batch(n: int, prompt_len: tuple[int, int], response_len: tuple[int, int], vocab: int, seed: int):
    import torch

    from orlhf.types import Experience

    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt_len[0], prompt_len[1] + 1, (n,), generator=g)
    r_lens = torch.randint(response_len[0], response_len[1] + 1, (n,), generator=g)
    P, A = int(p_lens.max()), int(r_lens.max())
    seq = torch.randint(4, vocab, (n, P + A), generator=g)
    attn = torch.zeros(n, P + A, dtype=torch.long)
    for i in range(n):
        attn[i, P - p_lens[i] : P + r_lens[i]] = 1
    seq[attn == 0] = 0
    mask = attn[:, P:].bool()
    return Experience(
        seq,
        attn,
        mask,
        action_log_probs=-torch.rand(n, A, generator=g) * mask,
        advantages=torch.randn(n, A, generator=g),
        returns=torch.randn(n, A, generator=g),
        values=torch.randn(n, A, generator=g),
    )


def model_path(args) -> str:
    if args.hidden is None:
        from orlhf.demo.builder import ensure_demo

        return str(ensure_demo().model)
    from model_presets import build_model  # benchmarks/model_presets.py: a random Llama, demo tokenizer

    return str(build_model(Path(args.out), args.hidden, args.layers, args.prompt_len[1] + args.response_len[1]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=64, help="samples (one rank's share of a step)")
    p.add_argument("--micro", type=int, default=16, help="micro-batch size, scoring and training")
    p.add_argument("--prompt_len", type=int, nargs=2, default=(8, 64), metavar=("LO", "HI"))
    p.add_argument("--response_len", type=int, nargs=2, default=(8, 256), metavar=("LO", "HI"))
    p.add_argument("--hidden", type=int, default=None, help="a random Llama of this width (default: the demo's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: as one orlhf rank on CPU)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_padding"))
    args = p.parse_args(argv)

    import torch

    from orlhf.config.worker_config import role_config
    from orlhf.cpu.rank_actor import tune_rank_process
    from orlhf.workers import PolicyWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cpu"
    )
    torch.set_num_threads(args.threads)
    path = model_path(args)
    from transformers import AutoConfig

    exp = make_batch(
        args.batch,
        tuple(args.prompt_len),
        tuple(args.response_len),
        AutoConfig.from_pretrained(path).vocab_size,
        seed=0,
    )
    real = exp.attention_mask.float().mean().item()
    results, reference = {}, None
    for name, kw in LAYOUTS.items():
        cfg = role_config(
            "actor",
            model_path=path,
            device="cpu",
            zero_stage=3,
            learning_rate=1e-5,
            train_batch_size=args.batch,
            micro_train_batch_size=args.micro,
            micro_forward_batch_size=args.micro,
            total_optimizer_steps=100,
            **kw,
        )
        worker = PolicyWorker(cfg)
        tune_rank_process()  # as orlhf's CPU rank processes do
        worker.init()
        batch = exp.as_sequence_batch()
        lp = worker.log_probs(batch)  # warm-up, and the log-probs compared below (before any train step)
        worker.train_step(exp)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            worker.log_probs(batch)
        score = (time.perf_counter() - t0) / args.repeats
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            worker.train_step(exp)
        train = (time.perf_counter() - t0) / args.repeats
        reference = lp if reference is None else reference
        diff = (lp - reference)[exp.action_mask].abs().max().item()
        results[name] = {"log_probs_s": score, "train_step_s": train, "max_abs_diff_vs_padded": diff}
        del worker
    base = results["padded"]
    print(
        f"batch {args.batch} x (prompt {args.prompt_len[0]}-{args.prompt_len[1]}, response "
        f"{args.response_len[0]}-{args.response_len[1]}) tokens, padded to {tuple(exp.sequences.shape)}: "
        f"{real:.0%} real tokens; micro-batch {args.micro}; model {Path(path).name}; {args.threads} thread(s)"
    )
    print("| layout | log_probs s | vs padded | train_step s | vs padded | max abs diff of log-probs vs padded |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['log_probs_s']:.3f} | {base['log_probs_s'] / r['log_probs_s']:.2f}x | "
            f"{r['train_step_s']:.3f} | {base['train_step_s'] / r['train_step_s']:.2f}x | "
            f"{r['max_abs_diff_vs_padded']:.1e} |"
        )
    print(
        json.dumps(
            {
                "benchmark": "bench_padding",
                "shape": list(exp.sequences.shape),
                "real_token_share": real,
                "micro": args.micro,
                "model": path,
                "threads": args.threads,
                "results": results,
                "speedup_vs_padded": {
                    n: {
                        "log_probs": base["log_probs_s"] / r["log_probs_s"],
                        "train_step": base["train_step_s"] / r["train_step_s"],
                    }
                    for n, r in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
