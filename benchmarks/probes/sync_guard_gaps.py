"""The sync guard's statistic, healthy and broken, on one model: what its calibration (trainer/sync_guard.py) rests on.
Results: benchmarks/results/2026-12-02-sync-guard-calibration.md.

A trainer (PolicyWorker, ZeRO-3, world 1) and an in-process vLLM engine joined by orlhf's gloo sync
(tests/vllm/family_rig.py); the gap is mean |engine - trainer| log-prob per token the engine sampled (16 prompts x
16 new tokens), as engine_logprob_gap in a run:
    step 1    both loaded the same folder, no sync yet: the healthy gap the guard calibrates on
    steps     --steps - 1 times: a PPO step with random advantages (lr --lr), the gap before the sync (an engine one
              update behind), the sync, the gap after it (healthy)
    breaks    --break_steps PPO steps, each synced broken as a sync once was: "unfixed" (vLLM's reload without
              orlhf's fix-ups: tied heads, pre-packed MoE experts), "drop" (the sync leaves decoder layer
              --drop_layer out), the gap after each; mended after
    at each sync, what the checks that need no threshold found: the stale-pack check's modules, the coverage
              check's weights left out (either stops a run at that sync, whatever the gap)
    start-up  the engine loads an edited copy of the folder: "rope" (another RoPE base), "zero_mlp" (layer
              --drop_layer's MLP down-projection zeroed), "noise_mlp" (the same with noise of its own size added)
    -> a table, and one final JSON line

Reproduce (2-core AVX2 CPU: a tiny family ~1 min; SmolLM2-135M fp32 ~6 min, bf16 ~4 min for step 1, steps 2 and rope):
    .venv/bin/python benchmarks/probes/sync_guard_gaps.py --model llama_tied --dtype bf16 --steps 16 --breaks ""
    .venv/bin/python benchmarks/probes/sync_guard_gaps.py --model real --lr 1e-6 --steps 3 --drop_layer 10 \\
        --startup rope,zero_mlp,noise_mlp
    .venv/bin/python benchmarks/probes/sync_guard_gaps.py --model real --lr 1e-6 --steps 1 --drop_layer 10 \\
        --break_steps 6
    .venv/bin/python benchmarks/probes/sync_guard_gaps.py --model real --dtype bf16 --lr 1e-6 --steps 2 --breaks "" \\
        --startup rope
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from orlhf.trainer.sync_guard import CEILING, calibrated  # noqa: E402
from tests.vllm.family_rig import FAMILIES, Rig, build_models, free_port  # noqa: E402

TEXTS = (
    "The capital of France is|What is 12 + 7? Answer:|Once upon a time, there was a|The best way to learn Python is|"
    "In 1969, the first man on the moon|A recipe for pancakes: first,|The weather today is|My favourite book is|"
    "def fibonacci(n):|The three primary colours are|Water boils at|To be or not to be,|"
    "The largest planet in the solar system|How do I sort a list in Python?|The history of Rome begins|"
    "Photosynthesis is the process"
).split("|")
TRAIN_TAIL = " and so on and so forth, as everyone knows, and this sentence goes on for a while longer."


def load(r: Rig, path: Path, engine_path: Path, bf16: bool, lr: float) -> None:
    """Rig.load with the learning rate of a real model's run, and another folder for the engine if asked."""
    from orlhf.rollout.weight_sync import plan_buckets

    r.start("trainer", "load", str(path), bf16, 1.0, lr, 3, 0)
    r.start("engine", "load", str(engine_path), bf16, 1.0)
    r.wait("trainer"), r.wait("engine")
    r.metas, r.buckets = plan_buckets(r.call("trainer", "metas", r.call("engine", "packed")), 256 * 2**20)
    port = free_port()
    r.start("engine", "join", "127.0.0.1", port)
    r.start("trainer", "join", "127.0.0.1", port)
    r.wait("trainer"), r.wait("engine")


def gap(r: Rig, prompts: list[list[int]], seed: int) -> float:
    seqs, engine = r.call("engine", "sample", prompts, 16, seed, 1.0)
    return (engine - r.call("trainer", "log_probs", seqs)[:, -16:]).abs().mean().item()


def inputs(model: Path, real: bool) -> tuple[list[list[int]], torch.Tensor]:
    """16 prompts of 8 tokens (text for the real model, random ids for tiny ones) and 4 training sequences."""
    if not real:
        prompts = torch.randint(4, 900, (16, 8), generator=torch.Generator().manual_seed(1)).tolist()
        return prompts, torch.randint(4, 900, (4, 24), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(t)["input_ids"][:8] for t in TEXTS]
    prompts = [p + [p[-1]] * (8 - len(p)) for p in prompts]
    return prompts, torch.tensor([tok(t + TRAIN_TAIL)["input_ids"][:20] for t in TEXTS[:4]])


def edited(model: Path, kind: str, layer: int, out: Path) -> Path:
    """A copy of the folder as an engine that differs from the start would hold it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if kind == "rope":
        m.config.rope_parameters["rope_theta"] = m.config.rope_parameters["rope_theta"] / 10
    else:
        w = m.model.layers[layer].mlp.down_proj.weight.data
        w.zero_() if kind == "zero_mlp" else w.add_(torch.randn_like(w) * w.std())
    m.save_pretrained(out / kind)
    AutoTokenizer.from_pretrained(model).save_pretrained(out / kind)
    return out / kind


def after_sync(r: Rig) -> str:
    """What the checks that need no threshold found at the sync just made: the stale-pack check's modules, the
    coverage check's weights left out (rollout/weight_sync.py); "" when neither found anything."""
    stale, left = r.call("engine", "stale_packs"), r.call("engine", "not_loaded")
    return "; ".join(
        f"{what}: {', '.join(names[:2])}{' ..' if len(names) > 2 else ''}"
        for what, names in (("stale pack", stale), (f"{len(left)} left out", left))
        if names
    )


def measure(args, r: Rig, model: Path, work: Path) -> tuple[dict, dict]:
    """({case: gap}, {case: what the threshold-free checks found at its sync})."""
    bf16, rows, found = args.dtype == "bf16", {}, {}
    prompts, train = inputs(model, args.model == "real")
    load(r, model, model, bf16, args.lr)
    rows["step 1 (healthy, calibrates)"] = gap(r, prompts, 1)
    for k in range(2, args.steps + 1):
        r.call("trainer", "train_step", train, k)
        rows[f"step {k}: one update behind"] = gap(r, prompts, 100 + k)
        r.sync()
        found[f"step {k}: healthy"] = after_sync(r)
        rows[f"step {k}: healthy"] = gap(r, prompts, 10 + k)
    for kind in filter(None, args.breaks.split(",")):
        r.call("engine", "break_sync", "unfixed" if kind == "unfixed" else f"drop:model.layers.{args.drop_layer}.")
        for k in range(1, args.break_steps + 1):  # the break stays: it grows with every update
            r.call("trainer", "train_step", train, 6 + k)
            r.sync()
            found[f"break: {kind}, update {k}"] = after_sync(r)
            rows[f"break: {kind}, update {k}"] = gap(r, prompts, 19 + k)
        r.call("engine", "break_sync", None)
        r.sync()
    r.unload()
    for kind in filter(None, args.startup.split(",")):
        load(r, model, edited(model, kind, args.drop_layer, work), bf16, args.lr)
        rows[f"start-up: {kind}"] = gap(r, prompts, 1)
        r.unload()
    return rows, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="real", help=f"'real' (SmolLM2-135M-Instruct) or a tiny family: {FAMILIES}")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--breaks", default="unfixed,drop")
    ap.add_argument("--startup", default="")
    ap.add_argument("--drop_layer", type=int, default=1)
    ap.add_argument("--break_steps", type=int, default=1, help="updates synced through each break, gap after each")
    ap.add_argument("--work", default="/tmp/orlhf-sync-guard-gaps")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.model == "real":
        from orlhf.demo.real_model import ensure_real_model

        model = ensure_real_model()
    else:
        model = Path(build_models(work, [args.model])[args.model])
    t0, r = time.time(), Rig(timeout_s=1800)
    try:
        rows, found = measure(args, r, model, work)
    finally:
        r.close()
    threshold, ceiling = calibrated(rows["step 1 (healthy, calibrates)"]), CEILING[args.dtype]
    print(f"\n{args.model} {args.dtype}, lr {args.lr:g}: calibrated threshold {threshold:.3g}, ceiling {ceiling:g}")
    for case, value in rows.items():
        bar = ceiling if case.startswith("start-up") else threshold  # judged at step 1, before any calibration
        by_gap = "stopped" if not value <= bar else "passes"
        print(f"  {case:<34} {value:10.3g}  {by_gap}{f'  (at the sync: {found[case]})' if found.get(case) else ''}")
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "lr": args.lr,
                "threshold": threshold,
                "gaps": rows,
                "found_at_sync": found,
                "seconds": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
