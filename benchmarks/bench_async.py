"""Async vs sync step time on the demo, and the overlap limit max(generation, training).

    python benchmarks/bench_async.py                       # demo defaults, 12 measured steps per mode
    python benchmarks/bench_async.py --generate_max_len 64 # a more generation-heavy step

Runs `orlhf train-ppo` three times in one invocation with identical flags: sync (split placement), async
(--async_train), hybrid (--colocate_all_models). Steps after --warmup are measured. From the sync run:
    gen   = mean timing/generate        (engines busy)
    train = mean of score + make_experience + train + sync  (trainers busy)
    limit = max(gen, train)             the best a perfect overlap of the two can do
Async's step time is the wall time between consecutive steps; the target is async <= 1.15 x limit.
Prints a table, then one JSON line.

Results: benchmarks/results/2026-11-21-async-overlap.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN_SIDE = ("timing/score", "timing/make_experience", "timing/train", "timing/sync")
MODES = {"sync": [], "async": ["--async_train"], "hybrid": ["--colocate_all_models"]}


def run_mode(name: str, extra: list[str], args, root: Path) -> list[dict]:
    save = root / name
    cmd = [
        str(Path(sys.executable).parent / "orlhf"),
        "train-ppo",
        "--device",
        "cpu",
        "--save_path",
        str(save),
        "--num_episodes",
        "100",
        "--stop_after_steps",
        str(args.warmup + args.steps),
        "--generate_max_len",
        str(args.generate_max_len),
        "--rollout_batch_size",
        str(args.rollout_batch_size),
        "--train_batch_size",
        str(args.rollout_batch_size),
        *extra,
        *args.extra,
    ]
    print(f"[bench_async] {name}: {' '.join(cmd[1:])}", file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=open(save.with_suffix(".log"), "w"))
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    return rows[args.warmup :]


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r.get(key, 0.0) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--generate_max_len", type=int, default=24)
    ap.add_argument("--rollout_batch_size", type=int, default=64)
    ap.add_argument("--modes", default="sync,async,hybrid")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("extra", nargs="*", help="more orlhf train-ppo flags (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="orlhf-bench-async-") as tmp:
        runs = {m: run_mode(m, MODES[m], args, Path(tmp)) for m in args.modes.split(",")}
    result: dict = {
        "bench": "async",
        "steps": args.steps,
        "generate_max_len": args.generate_max_len,
        "rollout_batch_size": args.rollout_batch_size,
    }
    print(f"{'mode':8s} {'step s':>8s} {'samples/s':>10s} {'generate':>9s} {'train side':>11s}")
    for mode, rows in runs.items():
        step, gen = mean(rows, "step_s"), mean(rows, "timing/generate")
        train = sum(mean(rows, k) for k in TRAIN_SIDE)
        result[mode] = {
            "step_s": step,
            "samples_per_s": mean(rows, "samples_per_s"),
            "generate_s": gen,
            "train_side_s": train,
        }
        print(f"{mode:8s} {step:8.3f} {mean(rows, 'samples_per_s'):10.1f} {gen:9.3f} {train:11.3f}")
    if "sync" in runs and "async" in runs:
        limit = max(result["sync"]["generate_s"], result["sync"]["train_side_s"])
        result["overlap_limit_s"] = limit
        result["async_over_limit"] = result["async"]["step_s"] / limit
        result["async_speedup_vs_sync"] = result["sync"]["step_s"] / result["async"]["step_s"]
        print(
            f"limit max(gen, train) = {limit:.3f} s; async / limit = {result['async_over_limit']:.2f} "
            f"(target <= 1.15); async speed-up vs sync = x{result['async_speedup_vs_sync']:.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
