"""--partial_rollout against plain --async_train on a long-tailed response length: samples/s and staleness.

    python benchmarks/bench_partial_rollout.py                        # both parts, about 6 minutes on 2 CPU cores
    python benchmarks/bench_partial_rollout.py --queue_sizes 2 --steps 12

1. A long tail: a copy of the demo model whose generation_config.json adds stop tokens, the word tokens the model
   samples most, until they make up --stop_rate of its samples (counted in HF samples of the demo prompts), so lengths
   are about geometric: most stop early, a few run on toward --generate_max_len. The length distribution of one
   step's samples is printed.
2. What a cut costs (one engine in a child process, no Ray, no sync): a step's prompts generated in one call, then in
   segments of S new tokens (rollout/partial.py PartialGenerator, nothing between segments) for each --segments;
   each cut re-reads prompt + response so far.
3. Whole runs: `orlhf train-ppo --async_train --async_queue_size Q` on that model for each Q of --queue_sizes,
   without and with --partial_rollout (--partial_rollout_tokens S), the same flags otherwise, interleaved;
   the steps after --warmup: samples/s (samples over the steps' wall time), the sync phase's seconds, per-token
   staleness (without --partial_rollout every token has its batch's staleness) and the share of samples that
   crossed a sync.
Prints tables, then one JSON line. Results: benchmarks/results/2026-11-26-partial-rollout.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def long_tail_model(root: Path, stop_rate: float) -> tuple[Path, list[int], float]:
    """(model folder, the added stop tokens, their summed sampled rate): the demo model, with the word tokens it
    samples most often added as stop tokens until their rates add up to `stop_rate` (about geometric lengths)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    model_dir = root / "long-tail-model"
    shutil.copytree(demo.model, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [json.loads(line)["prompt"] for line in open(demo.prompts)][:32]
    torch.manual_seed(0)
    counts = torch.zeros(model.config.vocab_size)
    for text in rows:
        ids = tok(text, return_tensors="pt").input_ids
        kw = dict(do_sample=True, top_k=0, top_p=1.0, max_new_tokens=64, num_return_sequences=4, eos_token_id=None)
        out = model.generate(ids, **kw)
        counts += torch.bincount(out[:, ids.shape[1] :].flatten(), minlength=len(counts)).float()
    rate = counts / counts.sum()
    rate[tok.all_special_ids] = 0.0
    stops, total = [], 0.0
    for t in rate.argsort(descending=True).tolist():
        if total >= stop_rate:
            break
        stops.append(t)
        total += float(rate[t])
    cfg_path = model_dir / "generation_config.json"
    gen = json.loads(cfg_path.read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], *stops]
    cfg_path.write_text(json.dumps(gen, indent=1))
    return model_dir, stops, total


def percentiles(lengths: list[int]) -> dict[str, float]:
    q = statistics.quantiles(lengths, n=100, method="inclusive")
    return {"mean": statistics.mean(lengths), "p50": q[49], "p90": q[89], "p99": q[98], "max": max(lengths)}


# ---- part 2: segment cost, one engine in a child process -----------------------------------------------------------
def segments_child(args) -> None:
    """Runs in a child process (--child): one EngineActor, no Ray; prints one JSON line."""
    import dataclasses

    from orlhf.config.resolve import finish_config
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.launch.bringup import tuning_for
    from orlhf.launch.run_inputs import load_prompts
    from orlhf.rollout.engine import EngineActor
    from orlhf.rollout.engine_config import engine_config
    from orlhf.rollout.partial import PartialGenerator
    from orlhf.types import SamplingSpec

    flags = {**run_flags(args, Path(args.child)), "device": "cpu"}
    cfg = finish_config(flags, frozenset(flags))
    prompts = load_prompts(cfg, load_tokenizer(cfg.data.pretrain))[: args.rollout_batch_size]
    p = cfg.ppo
    sampling = SamplingSpec(p.temperature, p.top_p, p.generate_max_len, p.n_samples_per_prompt, p.max_len, p.seed)
    ecfg = dataclasses.replace(engine_config(cfg), cpu_threads=1, enable_prefix_caching=args.prefix_caching)
    engine = EngineActor(ecfg, 0, tuning=tuning_for(cfg))

    class OneEngine:  # EngineGroup's two calls, on the engine in this process
        def generate(self, ids, sampling):
            return engine.generate(list(enumerate(ids)), sampling)

        def generate_requests(self, per_engine, sampling):
            return engine.generate_requests(per_engine.get(0, []), sampling)

    engine.generate([(0, prompts[0].ids)], sampling)  # warm-up
    modes = [("whole", None)] + [(f"S={s}", s) for s in args.segments]
    seconds: dict = {name: [] for name, _ in modes}
    out: dict = {}
    for _ in range(args.repeats):  # interleaved, so that load drift hits every mode alike
        for name, seg in modes:
            t0 = time.process_time()  # CPU seconds: the engine runs in this process, one thread; the load of a
            if seg is None:  # shared machine moves them far less than wall seconds
                rollouts, calls = OneEngine().generate([q.ids for q in prompts], sampling), 1
                out["lengths"] = sorted(len(r.response_ids) for r in rollouts)
            else:
                gen = PartialGenerator(OneEngine(), seg)
                rollouts, calls = gen.generate(prompts, sampling), gen.segments
            seconds[name].append(time.process_time() - t0)
            tokens = sum(len(r.response_ids) for r in rollouts)
            out[name] = {"s": statistics.median(seconds[name]), "tokens": tokens, "engine_calls": calls}
    print(json.dumps(out))


# ---- part 3: whole runs --------------------------------------------------------------------------------------------
def run_flags(args, model: Path) -> dict:
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    samples = args.rollout_batch_size * args.n
    return {
        "pretrain": str(model),
        "prompt_data": str(demo.prompts),
        "input_key": "prompt",
        "label_key": "label",
        "remote_rm_url": str(demo.reward_fn),
        "prompt_max_len": 64,
        "generate_max_len": args.generate_max_len,
        "rollout_batch_size": args.rollout_batch_size,
        "n_samples_per_prompt": args.n,
        "advantage_estimator": "group_norm",
        "train_batch_size": samples,
        "micro_train_batch_size": 16,
        "micro_rollout_batch_size": 32,
        "actor_learning_rate": 5e-4,
        "lr_warmup_ratio": 0.0,
        "enforce_eager": True,
    }


def run_mode(name: str, extra: list[str], args, model: Path, root: Path) -> list[dict]:
    save = root / name
    flags = [f"--{k}" if v is True else f"--{k}={v}" for k, v in run_flags(args, model).items()]
    cmd = [str(Path(sys.executable).parent / "orlhf"), "train-ppo", "--device", "cpu", "--save_path", str(save)]
    cmd += [*flags, "--num_episodes", "100", "--stop_after_steps", str(args.warmup + args.steps), *extra]
    print(f"[bench_partial_rollout] {name}: {' '.join(cmd[1:])}", file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=open(root / f"{name}.log", "w"))
    return [json.loads(line) for line in open(save / "metrics.jsonl")][args.warmup :]


def summary(rows: list[dict]) -> dict:
    seconds = sum(r["step_s"] for r in rows)
    token_mean = statistics.mean(r.get("token_staleness_mean", r["staleness"]) for r in rows)
    return {
        "samples_per_s": sum(r["samples"] for r in rows) / seconds,
        "step_s": seconds / len(rows),
        "generate_s": statistics.mean(r["timing/generate"] for r in rows),
        "sync_s": statistics.mean(r["timing/sync"] for r in rows),
        "token_staleness_mean": token_mean,
        "token_staleness_max": max(r.get("token_staleness_max", r["staleness"]) for r in rows),
        "crossed_sync_frac": statistics.mean(r.get("crossed_sync_frac", 0.0) for r in rows),
        "response_length_mean": statistics.mean(r["response_length"] for r in rows),
        "reward_mean": statistics.mean(r["reward_mean"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generate_max_len", type=int, default=384)
    ap.add_argument("--stop_rate", type=float, default=1 / 48, help="per-token rate of the added stop token")
    ap.add_argument("--rollout_batch_size", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="--n_samples_per_prompt")
    ap.add_argument("--partial_rollout_tokens", type=int, default=32)
    ap.add_argument("--queue_sizes", default="2", help="--async_queue_size values, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--segments", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128])
    ap.add_argument("--repeats", type=int, default=3, help="part 2: calls per mode, interleaved (median)")
    ap.add_argument("--with_prefix_cache", action="store_true", help="part 2 again with --enable_prefix_caching")
    ap.add_argument("--prefix_caching", action="store_true", help=argparse.SUPPRESS)  # part 2's child
    ap.add_argument("--parts", default="2,3")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        segments_child(args)
        return
    result: dict = {"bench": "partial_rollout", "generate_max_len": args.generate_max_len, "load_avg": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="orlhf-bench-partial-") as tmp:
        root = Path(tmp)
        model, stops, rate = long_tail_model(root, args.stop_rate)
        result.update(stop_tokens=stops, stop_rate=rate)
        print(f"long tail: {len(stops)} stop tokens added, sampled at {rate:.4f} per token by the demo model")
        if "2" in args.parts:
            segments = {}
            for cache in ("", "--prefix_caching") if args.with_prefix_cache else ("",):
                child = [sys.executable, __file__, "--child", str(model), *sys.argv[1:], *([cache] if cache else [])]
                out = subprocess.run(child, check=True, capture_output=True, text=True).stdout.strip().splitlines()
                part = json.loads(out[-1])
                segments.update({f"{k}{' +prefix cache' if cache else ''}": v for k, v in part.items()})
            lengths = segments.pop("lengths")
            segments.pop("lengths +prefix cache", None)
            result["lengths"] = {
                **percentiles(lengths),
                "stopped_within_32": sum(n <= 32 for n in lengths) / len(lengths),
            }
            result["segments"] = segments
            shown = ", ".join(f"{k} {v:.3g}" for k, v in result["lengths"].items())
            print(f"response lengths of one step ({len(lengths)} samples): {shown}")
            whole = segments["whole"]["s"] / segments["whole"]["tokens"]
            print(f"\n{'one step, one engine':26s} {'CPU s':>8s} {'tokens':>7s} {'calls':>6s} {'s/token x whole':>15s}")
            for name, r in segments.items():
                r["per_token_x_whole"] = r["s"] / r["tokens"] / whole
                print(
                    f"{name:26s} {r['s']:8.2f} {r['tokens']:7d} {r['engine_calls']:6d} {r['per_token_x_whole']:15.2f}"
                )
        if "3" in args.parts:
            runs = {}
            for q in args.queue_sizes.split(","):
                base = ["--async_train", "--async_queue_size", q]
                partial = [*base, "--partial_rollout", "--partial_rollout_tokens", str(args.partial_rollout_tokens)]
                for name, extra in ((f"async q={q}", base), (f"partial q={q}", partial)):
                    rows = run_mode(name.replace(" ", "_").replace("=", ""), extra, args, model, root)
                    runs[name] = summary(rows)
            result["runs"] = runs
            print(f"\n{'mode':14s} {'samples/s':>9s} {'step s':>7s} {'sync s':>7s} {'tok stale':>9s} {'max':>4s} "
                  f"{'crossed':>7s} {'resp len':>8s}")  # fmt: skip
            for name, r in runs.items():
                print(
                    f"{name:14s} {r['samples_per_s']:9.2f} {r['step_s']:7.2f} {r['sync_s']:7.2f} "
                    f"{r['token_staleness_mean']:9.2f} {r['token_staleness_max']:4.0f} {r['crossed_sync_frac']:7.2f} "
                    f"{r['response_length_mean']:8.1f}"
                )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
