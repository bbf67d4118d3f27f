"""A real-model run's vLLM-CPU engine, sampled each second: its minor page faults, CPU seconds and RSS; and the run's
weight-sync and generate seconds per step (metrics.jsonl). What a change to the engine's memory handling does to
the sync, measured in the process that does it.

    orlhf make-demo --real DEMO
    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/engine_sync_memory.py --demo DEMO --steps 20 --out OUT

The command is the demo's printed one (--init_kl_coef 0: no reference model), shortened to --steps steps of 64
samples. Faults, CPU and RSS count from the first sample, taken once the driver has named the engine's pid (the
engine is then starting). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sample(pid: int):
    """(minor faults, CPU seconds, RSS MiB) of a process, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss = next(
            int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:")
        )
    except (OSError, StopIteration):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(stat[7]), (int(stat[11]) + int(stat[12])) / tick, rss // 1024


def without_evaluations(argv: list[str]) -> list[str]:
    """The command's flags without its evaluations (--eval_dataset, --eval_steps and their values,
    --eval_before_train): every step's sync then does the same work."""
    out, values = [], iter(argv)
    for flag in values:
        if flag in ("--eval_dataset", "--eval_steps"):
            next(values, None)
        elif flag != "--eval_before_train":
            out.append(flag)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo", type=Path, required=True, help="orlhf make-demo --real's folder")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "engine_sync_memory")
    ap.add_argument("--flags", default="", help="extra train-ppo flags")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from orlhf.demo.arith import make_real_demo, train_command

    paths = make_real_demo(a.demo)
    printed = shlex.split(train_command(paths, save_path=str(a.out / "run")))
    argv2 = without_evaluations(printed[1:])
    # the demo's rollout batch is 8 prompts (x 8 samples): --steps steps read 8 x steps prompts
    cmd = [sys.executable, "-m", "orlhf.cli", *argv2, "--max_samples", str(a.steps * 8), *shlex.split(a.flags)]
    a.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.out / "run", ignore_errors=True)
    with (a.out / "driver.out").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    pid = None
    while pid is None and proc.poll() is None:
        m = re.search(r"vllm engines: 1, pids \[(\d+)\]", (a.out / "driver.out").read_text())
        pid = int(m.group(1)) if m else None
        time.sleep(0.2)
    rows = []
    while pid is not None and (s := sample(pid)) is not None:
        rows.append(s)
        time.sleep(1.0)
    proc.wait()
    if proc.returncode != 0 or not rows:
        sys.exit(f"the run exited {proc.returncode}; see {a.out / 'driver.out'}")
    metrics = [json.loads(x) for x in (a.out / "run" / "metrics.jsonl").read_text().splitlines()]
    sync = [m["timing/sync"] for m in metrics]
    gen = [m["timing/generate"] for m in metrics]
    rss = [r[2] for r in rows]
    startup = re.search(r"start-up ([\d.]+) s", (a.out / "driver.out").read_text())
    out = {
        "steps": len(metrics),
        "startup_s": float(startup.group(1)) if startup else None,
        "sync_s_step1": round(sync[0], 2),
        "sync_s_median_after": round(statistics.median(sync[1:]), 2) if len(sync) > 1 else None,
        "generate_s_median_after": round(statistics.median(gen[1:]), 2) if len(gen) > 1 else None,
        "engine_minor_faults": rows[-1][0] - rows[0][0],
        "engine_cpu_s": round(rows[-1][1] - rows[0][1], 1),
        "engine_rss_mib_max": max(rss),
        "engine_rss_mib_at_quarters": [rss[int(len(rss) * f)] for f in (0.25, 0.5, 0.75)],
    }
    print(f"steps {out['steps']}, start-up {out['startup_s']} s")
    print(
        f"sync: step 1 {out['sync_s_step1']} s, median after {out['sync_s_median_after']} s; generate median after "
        f"{out['generate_s_median_after']} s"
    )
    print(
        f"engine: {out['engine_minor_faults']} minor faults, {out['engine_cpu_s']} CPU s, RSS max "
        f"{out['engine_rss_mib_max']} MiB (at 1/4, 1/2, 3/4 of the run: {out['engine_rss_mib_at_quarters']})"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
