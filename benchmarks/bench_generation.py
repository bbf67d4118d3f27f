"""Generation throughput: the same model in vLLM (in-process, eager, as orlhf's engines run it on CPU) against
HF `generate` (batched, left-padded), same prompts, same number of new tokens, sampling at temperature 1.

    parent: tokenizes the prompts, starts one process per side, then runs --repeats rounds; in each round the
            sides take turns (order alternating), one idle while the other generates
      |-- side "hf"    AutoModelForCausalLM.generate(do_sample, top_k=0, min_new_tokens=max_new_tokens=N)
      '-- side "vllm"  LLM(enforce_eager, VLLM_ENABLE_V1_MULTIPROCESSING=0).generate(TokensPrompt...,
                       min_tokens=max_tokens=N, ignore_eos), per round each of --variants (default all):
                         orlhf        logprobs=0, detokenize=False (what EngineActor.generate asks for)
                         orlhf+detok  logprobs=0 with vLLM's default detokenizing
                         plain        no logprobs, no detokenizing (what HF generate does)

    --sweep demo,small,...: the same comparison for each model preset in turn (benchmarks/model_presets.py:
            the demo model, then random Llamas of 3.7-51M parameters with its tokenizer, built once), then tokens/s and
            ratios per size and the crossover, with log-probs ("orlhf") and without ("plain"): the smallest preset
            from which vLLM stays ahead of HF generate (model_presets.crossover). Its defaults are orlhf's demo
            step: 64 prompts x 4 samples (vLLM n=4, HF num_return_sequences=4) x 24 new tokens.

Why separate processes: in-process vLLM initialises torch.distributed and replaces torch.set_num_threads in its
process (later calls are ignored), so a side's thread count is fixed at start: --threads N starts both with
OMP_NUM_THREADS=N (default: unset, torch's default of one thread per core). orlhf's engines run as 1-CPU Ray
actors, and Ray sets OMP_NUM_THREADS=1 for those: --threads 1 is the setting orlhf's engines actually get.
Why rounds: on a shared 2-core machine a burst from another job can slow one call many times over (OpenMP teams
spin on busy cores); rounds put both sides under the same conditions. Reported: the ratio of medians, the median of
per-round ratios, and best-of-rounds (the uncontended speed). Both sides produce exactly num_prompts x N
tokens per call (checked); tokens/s = those tokens / wall time of one generate call (prompts pre-tokenized;
model load and engine start-up reported apart). One warm-up call per side and variant.

Reproduce (2-core CPU box, ~40 s when the machine is quiet; each side is a plain subprocess that exits with
the parent; no Ray):
    .venv/bin/python benchmarks/bench_generation.py --out /tmp/bench_generation.json
    .venv/bin/python benchmarks/bench_generation.py --threads 1
    .venv/bin/python benchmarks/bench_generation.py --num_prompts 64 --max_new_tokens 64 --model /path/to/hf_folder
    .venv/bin/python benchmarks/bench_generation.py --sweep all --threads 1 --repeats 3   # ~8 min

Results: benchmarks/results/2026-11-21-generation-demo.md and 2026-11-23-generation-sweep.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from model_presets import (
    PRESETS,
    crossover,
    describe_crossover,
    parse_presets,
    preset_model,  # noqa: E402
    preset_params,
)  # benchmarks/model_presets.py

# SamplingParams on top of the shared ones. "orlhf" must stay in step with EngineActor.generate
# (orlhf/rollout/engine.py); "orlhf+detok" is what it asked for before it set detokenize=False.
VLLM_VARIANTS = {
    "orlhf": {"logprobs": 0, "detokenize": False, "flat_logprobs": True},
    "orlhf+detok": {"logprobs": 0},
    "plain": {"detokenize": False},
}
SETTLE_S = 0.5  # pause between turns: OpenMP threads of the side that just ran stop spinning


def log(msg: str) -> None:
    print(f"[bench_generation] {msg}", file=sys.stderr, flush=True)


def load_prompts(model: str, n: int) -> list[list[int]]:
    """The first n demo prompts, tokenized by the model's tokenizer (no special tokens, as orlhf's data does)."""
    from transformers import AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    rows = [json.loads(line) for line in open(ensure_demo().prompts)]
    if n > len(rows):
        raise SystemExit(f"--num_prompts {n}: the demo has {len(rows)} prompts")
    tok = AutoTokenizer.from_pretrained(model)
    return [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:n]]


# ---- the two sides, each in its own process: `generate(new_tokens, seed) -> {variant: (seconds, tokens)}` ------


def hf_side(args, prompts: list[list[int]]):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded (B, T)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(new_tokens: int, seed: int) -> dict:
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad,
                num_return_sequences=args.n,
            )
        return {"hf": (time.perf_counter() - t0, (out.shape[1] - width) * out.shape[0])}  # (B x n, T + new)

    return generate, {"threads": torch.get_num_threads()}


def vllm_side(args, prompts: list[list[int]]):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, as orlhf's CPU engines
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from orlhf.cpu.engine_sampler import install

    install()  # as EngineActor: block-drawn seeds, eager rank count (same tokens as vLLM's own sampler)
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=max(map(len, prompts)) + args.max_new_tokens + 8,
        kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30),
    )
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def generate(new_tokens: int, seed: int) -> dict:
        out = {}
        for name in args.variants:
            params = [
                SamplingParams(
                    n=args.n,
                    temperature=1.0,
                    top_p=1.0,
                    max_tokens=new_tokens,
                    min_tokens=new_tokens,
                    ignore_eos=True,
                    seed=seed * 100003 + i,
                    **VLLM_VARIANTS[name],
                )
                for i in range(len(prompts))
            ]
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            out[name] = (time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs))
        return out

    return generate, {"threads": torch.get_num_threads()}


def serve(side: str, args) -> None:
    """Child: load, answer READY, then one line per command ("run SEED" or "quit") on stdin."""
    prompts = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    generate, info = (hf_side if side == "hf" else vllm_side)(args, prompts)
    info["startup_s"] = time.perf_counter() - t0
    generate(min(args.max_new_tokens, 8), seed=0)  # warm-up
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "quit":
            return
        print("RESULT " + json.dumps(generate(args.max_new_tokens, seed=int(cmd[1]))), flush=True)


# ---- the parent ---------------------------------------------------------------------------------------------


class Side:
    def __init__(self, side: str, args, prompts: list[list[int]]):
        self.name = side
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--_side",
            side,
            "--model",
            args.model,
            "--num_prompts",
            str(args.num_prompts),
            "--max_new_tokens",
            str(args.max_new_tokens),
            "--n",
            str(args.n),
            "--variants",
            ",".join(args.variants),
            "--kv_cache_gb",
            str(args.kv_cache_gb),
        ]
        self.log = open(os.devnull, "w") if not args.verbose else None
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        self.info = self._read("READY")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1 :])
        raise SystemExit(f"the {self.name} side exited (code {self.proc.wait()}); rerun with --verbose")

    def run(self, seed: int) -> dict:
        self.proc.stdin.write(f"run {seed}\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def measure(args) -> dict:
    prompts = load_prompts(args.model, args.num_prompts)
    sides: list[Side] = []
    try:
        for name in ("hf", "vllm"):  # one at a time: start-ups do not overlap either
            sides.append(Side(name, args, prompts))
            log(f"{name} ready: {sides[-1].info}")
        rounds = []
        for r in range(args.repeats):
            result = {}
            for side in sides if r % 2 == 0 else sides[::-1]:
                time.sleep(SETTLE_S)
                result.update(side.run(seed=1 + r))
            rounds.append(result)
            log(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {s:.3f} s" for k, (s, _) in result.items()))
    finally:
        for side in sides:
            side.close()
    return summarize(args, rounds, sides[0].info, sides[1].info)


def suffix(variant: str) -> str:
    """The JSON keys' suffix of a vLLM variant: orlhf -> "", orlhf+detok -> "_detok", plain -> "_plain"."""
    return "" if variant == "orlhf" else "_" + variant.replace("orlhf+", "")


def summarize(args, rounds: list[dict], hf: dict, vl: dict) -> dict:
    want = args.num_prompts * args.n * args.max_new_tokens
    for r in rounds:
        for name, (_, tokens) in r.items():
            if tokens != want:
                raise SystemExit(f"{name} produced {tokens} tokens, expected {want}")
    secs = {name: [r[name][0] for r in rounds] for name in rounds[0]}
    out = {
        "bench": "generation",
        "model": args.model,
        "threads_flag": args.threads,
        "num_prompts": args.num_prompts,
        "samples_per_prompt": args.n,
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_call": want,
        "repeats": args.repeats,
    }
    hf_s, hf_best = statistics.median(secs["hf"]), min(secs["hf"])
    out.update({"hf_s": hf_s, "hf_tok_s": want / hf_s, "hf_best_s": hf_best})
    for k in args.variants:
        sfx = suffix(k)
        s, best = statistics.median(secs[k]), min(secs[k])
        out.update(
            {
                f"vllm{sfx}_s": s,
                f"vllm{sfx}_tok_s": want / s,
                f"ratio{sfx}": hf_s / s,
                f"ratio{sfx}_per_round": statistics.median(h / v for h, v in zip(secs["hf"], secs[k])),
                f"vllm{sfx}_best_s": best,
                f"ratio{sfx}_best": hf_best / best,
            }
        )
    out.update(
        {
            "hf_threads": hf["threads"],
            "vllm_threads": vl["threads"],
            "hf_startup_s": hf["startup_s"],
            "vllm_startup_s": vl["startup_s"],
            "vllm_variants": {k: VLLM_VARIANTS[k] for k in args.variants},
            "seconds_all": secs,
        }
    )
    return out


def table(r: dict) -> str:
    rows = [
        (
            "side",
            "threads",
            "start-up s",
            "generate s (median)",
            "tokens/s",
            "vs HF",
            "vs HF per round",
            "best s",
            "tokens/s best",
            "vs HF best",
        )
    ]
    rows.append(
        (
            "HF generate",
            str(r["hf_threads"]),
            f"{r['hf_startup_s']:.1f}",
            f"{r['hf_s']:.3f}",
            f"{r['hf_tok_s']:.0f}",
            "1.00x",
            "1.00x",
            f"{r['hf_best_s']:.3f}",
            f"{r['tokens_per_call'] / r['hf_best_s']:.0f}",
            "1.00x",
        )
    )
    for k in r["vllm_variants"]:
        sfx = suffix(k)
        rows.append(
            (
                f"vLLM {k}",
                str(r["vllm_threads"]),
                f"{r['vllm_startup_s']:.1f}",
                f"{r[f'vllm{sfx}_s']:.3f}",
                f"{r[f'vllm{sfx}_tok_s']:.0f}",
                f"{r[f'ratio{sfx}']:.2f}x",
                f"{r[f'ratio{sfx}_per_round']:.2f}x",
                f"{r[f'vllm{sfx}_best_s']:.3f}",
                f"{r['tokens_per_call'] / r[f'vllm{sfx}_best_s']:.0f}",
                f"{r[f'ratio{sfx}_best']:.2f}x",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    head = (
        f"{r['num_prompts']} prompts x {r['samples_per_prompt']} samples x {r['max_new_tokens']} new tokens = "
        f"{r['tokens_per_call']} tokens per "
        f"call, sampling T=1, median of {r['repeats']} rounds; model {r['model']}"
    )
    return head + "\n" + "\n".join(lines)


# ---- --sweep: the same comparison for each model preset, then where vLLM overtakes HF -------------------------


def sweep(args) -> dict:
    """measure() for each preset in turn (same prompts, same work), a summary row per size, the crossovers."""
    rows, results = [], {}
    for name in args.sweep:
        args.model = str(preset_model(name, max_len=max_prompt_len(args) + args.max_new_tokens + 8))
        log(f"preset {name}: {args.model}")
        r = results[name] = measure(args)
        params = preset_params(name)
        print(f"\n## {name} ({params / 1e6:.1f}M params)\n" + table(r), flush=True)
        row = {"preset": name, "params": params, "hf_tok_s": r["hf_tok_s"]}
        row.update({f"vllm{suffix(k)}_tok_s": r[f"vllm{suffix(k)}_tok_s"] for k in args.variants})
        row.update({f"ratio{suffix(k)}": r[f"ratio{suffix(k)}"] for k in args.variants})
        rows.append(row)
    crossovers = {k: crossover(rows, f"ratio{suffix(k)}") for k in args.variants}
    return {
        "bench": "generation_sweep",
        "threads_flag": args.threads,
        "num_prompts": args.num_prompts,
        "samples_per_prompt": args.n,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "sizes": rows,
        "crossover": crossovers,
        "crossover_text": {k: describe_crossover(rows, f"ratio{suffix(k)}") for k in args.variants},
        "load_avg": os.getloadavg(),
        "per_size": results,
    }


def sweep_table(r: dict) -> str:
    variants = list(r["crossover"])
    head = "| preset | params | HF tok/s | " + " | ".join(f"vLLM {k} tok/s | vs HF" for k in variants) + " |"
    lines = [head, "|" + "---|" * (3 + 2 * len(variants))]
    for row in r["sizes"]:
        cells = [row["preset"], f"{row['params'] / 1e6:.1f}M", f"{row['hf_tok_s']:.0f}"]
        for k in variants:
            cells += [f"{row[f'vllm{suffix(k)}_tok_s']:.0f}", f"{row[f'ratio{suffix(k)}']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    what = {
        "orlhf": "with log-probs (as orlhf's engines)",
        "plain": "without log-probs",
        "orlhf+detok": "with log-probs and detokenizing",
    }
    lines += [f"crossover, vLLM {k} {what.get(k, '')}: {r['crossover_text'][k]}" for k in variants]
    return (
        f"\n{r['num_prompts']} prompts x {r['samples_per_prompt']} samples x {r['max_new_tokens']} new tokens, "
        f"median of {r['repeats']} rounds, threads {r['threads_flag'] or 'unset'}\n" + "\n".join(lines)
    )


def max_prompt_len(args) -> int:
    return max(map(len, load_prompts(str(preset_model("demo")), args.num_prompts)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="demo",
        help=f"HF folder or a model preset ({', '.join(PRESETS)}); default: the built-in demo model",
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="PRESETS",
        help="comma list of model presets (or 'all'), compared one after the other; then the crossover",
    )
    p.add_argument("--num_prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 1; with --sweep 4, as the demo)")
    p.add_argument("--max_new_tokens", type=int, default=None, help="default 64; with --sweep 24, as the demo")
    p.add_argument(
        "--variants",
        default=None,
        help=f"vLLM variants, comma list of {tuple(VLLM_VARIANTS)} (default: all; with --sweep orlhf,plain)",
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--kv_cache_gb", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both sides (default: unset)")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    p.add_argument("--verbose", action="store_true", help="show the sides' logs")
    p.add_argument("--_side", choices=("hf", "vllm"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sweep is not None and args.model != "demo":
        p.error("--sweep names the models: leave out --model")
    swept = args.sweep is not None
    args.n = args.n or (4 if swept else 1)
    args.max_new_tokens = args.max_new_tokens or (24 if swept else 64)
    args.variants = (args.variants or ("orlhf,plain" if swept else ",".join(VLLM_VARIANTS))).split(",")
    bad = [v for v in args.variants if v not in VLLM_VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {tuple(VLLM_VARIANTS)}")
    if swept:
        try:
            args.sweep = parse_presets(args.sweep)
        except SystemExit as e:
            p.error(f"--sweep: {e}")
    elif args.model in PRESETS:
        args.model = str(preset_model(args.model))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` / kill: still run the clean-up below
    if args._side:
        serve(args._side, args)
        return
    result = sweep(args) if args.sweep else measure(args)
    print(sweep_table(result) if args.sweep else table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
