"""The real model's run to its first step, from two trees of this repository in alternation: the start-up and its
phases (<save_path>/startup.json), in the same Python environment, so that a start-up change is measured against
the tree before it in one window of the machine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/startup_ab.py --base fb616af --pairs 5

--base: a commit, checked out into a temporary worktree ("before"); the working tree is "after". Each run is
trl_compare.py's orlhf command as benchmarks/results run it on the real model (`--model_preset smollm2
--prompts_per_step 16 --micro_batch 16 --episodes 1 --lr 1e-6`: 16 prompts x 4 samples, 24 new tokens, KL 0.01),
with one step's samples (--max_samples 16). Prints one line per run, the load average beside it, and the
median of each phase per side. The first run after the machine sat idle is slower for both sides (file caches,
the VM's pages): run it with one pair more than needed and leave the first pair out, as the results files do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trl_compare  # noqa: E402 - its command lines, so both sides run what the comparison with TRL runs


def run_command(out: Path) -> list[str]:
    flags = "--model_preset smollm2 --prompts_per_step 16 --micro_batch 16 --max_samples 16 --episodes 1 --lr 1e-6"
    a = trl_compare.parse_args([*flags.split(), "--out", str(out)])
    return trl_compare.with_model(trl_compare.orlhf_cmd(a, asynchronous=False), a)


def one_start(tree: Path, cmd: list[str], save: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([*cmd, "--save_path", str(save)], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{tree}: the run failed:\n{done.stderr[-3000:]}")
    return json.loads((save / "startup.json").read_text())


@contextmanager
def base_worktree(commit: str, prefix: str) -> Iterator[tuple[Path, Path]]:
    """`commit` checked out into a temporary worktree, removed on leaving: yields (that tree, a folder for the runs)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    before = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), commit], check=True)
    try:
        yield before, work
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)


def alternate(pairs: int, before: Path) -> Iterator[tuple[int, str, Path, float]]:
    """(pair index, side, tree, load average now) for each run: the base tree, then the working tree, `pairs` times."""
    for i in range(pairs):
        for side, tree in (("before", before), ("after", ROOT)):
            yield i, side, tree, os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit measured as 'before'")
    ap.add_argument("--pairs", type=int, default=5)
    a = ap.parse_args()
    with base_worktree(a.base, "startup_ab_") as (before, work):
        cmd = run_command(ROOT / "runs" / "startup_ab")
        rows: dict[str, list[dict]] = {"before": [], "after": []}
        for i, side, tree, load in alternate(a.pairs, before):
            got = one_start(tree, cmd, work / f"{side}-{i}")
            rows[side].append(got)
            phases = ", ".join(f"{k} {v:.1f}" for k, v in got["phases_s"].items())
            print(f"{i + 1} {side:6s} load {load:.2f}: start-up {got['total_s']:.1f} s ({phases})", flush=True)
        medians = {
            side: {
                "total_s": round(statistics.median(r["total_s"] for r in rs), 2),
                **{k: round(statistics.median(r["phases_s"].get(k, 0.0) for r in rs), 2) for k in rs[0]["phases_s"]},
            }
            for side, rs in rows.items()
        }
        print(json.dumps({"base": a.base, "load_avg": os.getloadavg(), "medians": medians}))


if __name__ == "__main__":
    main()
