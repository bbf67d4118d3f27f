"""The real model's first steps, from two trees of this repository in alternation: the start-up, each step's
generate phase and the engine process's peak resident memory, in the same Python environment, so that a change to
the engine (its start, its KV cache) is measured against the tree before it in one window of the machine, for what
it moves from the start-up into the steps as well as for what it saves.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/steps_ab.py --base 666227b --pairs 3

--base: a commit, checked out into a temporary worktree ("before"); the working tree is "after". Each run is
trl_compare.py's orlhf command on the real model (`--model_preset smollm2 --prompts_per_step 16 --micro_batch 16
--episodes 1 --lr 1e-6`: 16 prompts x 4 samples, 24 new tokens, KL 0.01) with --steps steps' samples. The engine's
resident memory (VmRSS of the process whose command line names EngineActor) is sampled twice a second. Prints one
line per run with the load average beside it, then a JSON summary (medians per side).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trl_compare  # noqa: E402 - its command lines, so both sides run what the comparison with TRL runs
from probes.startup_ab import alternate, base_worktree  # noqa: E402 - the same worktree and alternation


def run_command(steps: int, out: Path) -> list[str]:
    flags = f"--model_preset smollm2 --prompts_per_step 16 --micro_batch 16 --max_samples {16 * steps}"
    a = trl_compare.parse_args([*flags.split(), "--episodes", "1", "--lr", "1e-6", "--out", str(out)])
    return trl_compare.with_model(trl_compare.orlhf_cmd(a, asynchronous=False), a)


def engine_rss_kib() -> int:
    """The largest VmRSS among processes whose command line names EngineActor (Ray's worker titles), 0 if none."""
    most = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"EngineActor" not in f.read():
                    continue
            with open(f"/proc/{pid}/status") as f:
                most = max([most] + [int(line.split()[1]) for line in f if line.startswith("VmRSS:")])
        except OSError:
            continue
    return most


def one_run(tree: Path, cmd: list[str], save: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    with open(save.parent / f"{save.name}.log", "w") as log:
        run = subprocess.Popen([*cmd, "--save_path", str(save)], cwd=tree, env=env, stdout=log, stderr=log)
        peak = 0
        while run.poll() is None:
            peak = max(peak, engine_rss_kib())
            time.sleep(0.5)
    if run.returncode != 0:
        sys.exit(f"{tree}: the run failed (exit {run.returncode}); its output: {save.parent / save.name}.log")
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "startup_s": json.loads((save / "startup.json").read_text())["total_s"],
        "generate_s": [round(r["timing/generate"], 2) for r in rows if "timing/generate" in r],
        "engine_peak_rss_mib": round(peak / 1024),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit measured as 'before'")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    with base_worktree(a.base, "steps_ab_") as (before, work):
        cmd = run_command(a.steps, ROOT / "runs" / "steps_ab")
        rows: dict[str, list[dict]] = {"before": [], "after": []}
        for i, side, tree, load in alternate(a.pairs, before):
            got = one_run(tree, cmd, work / f"{side}-{i}")
            rows[side].append(got)
            print(
                f"{i + 1} {side:6s} load {load:.2f}: start-up {got['startup_s']:.1f} s, generate per step "
                f"{got['generate_s']} s (sum {sum(got['generate_s']):.2f}), engine peak RSS "
                f"{got['engine_peak_rss_mib']} MiB",
                flush=True,
            )
        summary = {
            side: {
                "startup_s": statistics.median(r["startup_s"] for r in rs),
                "first_generate_s": statistics.median(r["generate_s"][0] for r in rs),
                "later_generate_s_sum": statistics.median(sum(r["generate_s"][1:]) for r in rs),
                "engine_peak_rss_mib": statistics.median(r["engine_peak_rss_mib"] for r in rs),
            }
            for side, rs in rows.items()
        }
        print(json.dumps({"base": a.base, "steps": a.steps, "load_avg": os.getloadavg(), "medians": summary}))


if __name__ == "__main__":
    main()
