"""Seeded reference runs, and whether two sets of them logged the same numbers.

A refactor that should not change behaviour is checked by running the same seeded configurations before and
after it and comparing their metrics.jsonl row by row, every field but wall-clock ones (timings, rates):

    python scripts/same_runs.py record DIR          # the runs below, each into DIR/<name>
    python scripts/same_runs.py compare DIR_A DIR_B # IDENTICAL or the first differing field per run; exit 1 if any

Runs (the built-in demo, CPU): the default PPO (GAE: actor, critic, reference), GRPO with a KL loss and four
samples per prompt, the default with --async_train, and the default generating in the actor's ranks
(--rollout_backend trainer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMMON = ["--device", "cpu", "--num_episodes", "1", "--max_samples", "256", "--seed", "7"]
RUNS = {
    "gae": [],
    "grpo_kl": ["--advantage_estimator", "group_norm", "--use_kl_loss", "--n_samples_per_prompt", "4"],
    "async": ["--async_train"],
    "in_trainer": ["--rollout_backend", "trainer"],
}


def is_clock(key: str) -> bool:
    """Fields that read a clock (phase timings, seconds, rates): they differ between any two runs."""
    return key.startswith("timing/") or key.endswith(("_s", "per_s")) or "time" in key or "wall" in key


def record(out: Path, names: list[str]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    for name in names:
        save = out / name
        cmd = [sys.executable, "-m", "orlhf.cli", "train-ppo", *COMMON, *RUNS[name], "--save_path", str(save)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def rows(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not is_clock(k)}
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def compare(a: Path, b: Path) -> bool:
    same = True
    for name in RUNS:
        missing = [str(d / name) for d in (a, b) if not (d / name / "metrics.jsonl").exists()]
        if missing:
            print(f"{name}: no metrics.jsonl in {', '.join(missing)}")
            same = False
            continue
        ra, rb = rows(a / name / "metrics.jsonl"), rows(b / name / "metrics.jsonl")
        diff = next(
            (
                (i, k, x.get(k), y.get(k))
                for i, (x, y) in enumerate(zip(ra, rb))
                for k in sorted(set(x) | set(y))
                if x.get(k) != y.get(k)
            ),
            None,
        )
        if len(ra) != len(rb):
            print(f"{name}: {len(ra)} rows against {len(rb)}")
            same = False
        elif diff:
            print(f"{name}: row {diff[0]} field {diff[1]}: {diff[2]} != {diff[3]}")
            same = False
        else:
            print(f"{name}: IDENTICAL ({len(ra)} rows, {len(ra[0]) if ra else 0} fields each)")
    return same


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "record":
        record(Path(argv[1]), argv[2:] or list(RUNS))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return 0 if compare(Path(argv[1]), Path(argv[2])) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
