"""The real-model recipe, run as a user runs it: held-out accuracy before and after, start-up, and memory.

orlhf make-demo --real (demo/arith.py: SmolLM2-135M-Instruct, the addition task, its held-out test split)
-> the exact command it prints (train_command), run as a subprocess, its process tree sampled
   (proctree.TreeSampler: peak RSS per group: driver, actor rank, vLLM engine, Ray's own)
-> `orlhf plan` with the same flags on this machine: its memory estimate beside the measured peaks
-> a table: held-out greedy pass@1 at every evaluation (step 0 = the model before training), start-up to the
   first step, seconds per step, peak RSS against the plan; and one final JSON line

PYTHONPATH=$PWD .venv/bin/python benchmarks/real_model_recipe.py               # ~30-40 min on 2 cores
PYTHONPATH=$PWD .venv/bin/python benchmarks/real_model_recipe.py --flags "--max_samples 80"   # shorter
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from proctree import run_sampled  # noqa: E402  (benchmarks/proctree.py)

MIB = 2**20


def plan_lines(argv: list[str]) -> list[str]:
    """`orlhf plan` on this machine with the run's flags (its save path aside): its memory lines."""
    i = argv.index("--save_path")
    keep = argv[:i] + argv[i + 2 :]
    res = subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "plan", *keep], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    return [line for line in res.stdout.splitlines() if re.search(r"GiB|MiB|memory", line)] or [
        f"orlhf plan exited {res.returncode}: {res.stderr.strip()[-300:]}"
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "real_model_recipe")
    ap.add_argument("--flags", default="", help="extra train-ppo flags, after the printed command's")
    ap.add_argument("--timeout", type=float, default=4 * 3600)
    a = ap.parse_args(argv)
    from orlhf.demo.arith import make_real_demo, train_command

    a.out.mkdir(parents=True, exist_ok=True)
    paths = make_real_demo(a.out / "demo")
    save = a.out / "run"
    printed = train_command(paths, save_path=str(save))
    cmd = [sys.executable, "-m", "orlhf.cli", *shlex.split(printed)[1:], *shlex.split(a.flags)]
    print(f"running: {printed} {a.flags}".rstrip(), flush=True)
    save.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "startup.json"):
        (save / stale).unlink(missing_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    t0, load0 = time.monotonic(), os.getloadavg()
    rc, sampler = run_sampled(cmd, ROOT, a.out / "run.log", env, a.timeout)
    wall = time.monotonic() - t0
    if rc != 0:
        tail = (a.out / "run.log").read_text(errors="replace").strip().splitlines()[-10:]
        raise SystemExit(f"the run exited {rc}:\n" + "\n".join(tail))
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "step_s" in r]
    startup = json.loads((save / "startup.json").read_text())
    plan = plan_lines(cmd[4:])  # the flags after `python -m orlhf.cli train-ppo`
    result = {
        "command": printed + (" " + a.flags if a.flags else ""),
        "heldout_pass1": {str(s): round(v, 4) for s, v in evals},
        "heldout_before": evals[0][1],
        "heldout_after": evals[-1][1],
        "ratio": evals[-1][1] / evals[0][1] if evals[0][1] else float("inf"),
        "train_reward_first5": statistics.mean(r["reward_mean"] for r in steps[:5]),
        "train_reward_last5": statistics.mean(r["reward_mean"] for r in steps[-5:]),
        "startup_s": round(startup["total_s"], 1),
        "step_s_median": statistics.median(r["step_s"] for r in steps),
        "phases_s_median": {
            k[7:]: round(statistics.median(r[k] for r in steps if k in r), 2)
            for k in sorted({k for r in steps for k in r if k.startswith("timing/")})
        },
        "steps": len(steps),
        "wall_s": wall,
        "peak_rss_mib": {g: round(v / MIB) for g, v in sorted(sampler.peak.items())},
        "plan": plan,
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg(),
    }
    print(f"\nheld-out greedy pass@1 ({len(paths.test.read_text().splitlines())} test prompts, never trained on):")
    for s, v in evals:
        print(f"  step {s:>3}: {v:.3f}")
    print(f"before {result['heldout_before']:.3f} -> after {result['heldout_after']:.3f} (x{result['ratio']:.2f})")
    print(f"start-up to the first step {result['startup_s']} s; median step {result['step_s_median']:.1f} s")
    print(f"phases (median s): {result['phases_s_median']}")
    print("peak RSS (MiB, summed per group): " + ", ".join(f"{g} {v}" for g, v in result["peak_rss_mib"].items()))
    print("orlhf plan for the same flags:\n  " + "\n  ".join(plan))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
