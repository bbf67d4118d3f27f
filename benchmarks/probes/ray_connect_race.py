"""ray.init alone, Ray's socket connect retry against orlhf's quick connects (distributed/ray_start.py
QUICK_CONNECTS), alternating, each in a fresh process: ray.init's wall, and the raylet's wait between its plasma
store's start and its object manager's ("Plasma store debug dump" -> "ObjectManager server started" in raylet.out).
That wait is the connect race: about 1.0 s when the raylet's first connect to the store's socket is refused with
Ray's retry interval, 0.1 s with orlhf's, near 0 when it is not refused.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/ray_connect_race.py --pairs 6

Prints one line per start and, per side, the median ray.init and the starts that lost the race.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, re, sys, time
import ray
from orlhf.distributed.ray_start import with_quick_connects
options = {"address": "local", "num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
if sys.argv[1] == "quick":
    options = with_quick_connects(options)
t = time.perf_counter()
ray.init(**options)
init_s = time.perf_counter() - t
session = ray._private.worker._global_node.get_session_dir_path()
ray.shutdown()
lines = open(os.path.join(session, "logs", "raylet.out")).read().splitlines()
def at(text):
    for line in lines:
        m = re.search(r"(\d\d):(\d\d):(\d\d)[.,](\d{3})", line)
        if text in line and m:
            return int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) + int(m[4]) / 1000
a, b = at("Plasma store debug dump"), at("ObjectManager server started")
print(json.dumps({"init_s": init_s, "store_wait_s": None if a is None or b is None else b - a}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6)
    a = ap.parse_args()
    rows: dict[str, list[dict]] = {"ray": [], "quick": []}
    for i in range(a.pairs):
        for side in rows:
            done = subprocess.run([sys.executable, "-c", CHILD, side], capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{side}: ray.init failed:\n{done.stderr[-2000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[side].append(row)
            wait = row["store_wait_s"]
            print(
                f"{i + 1} {side:5s} load {os.getloadavg()[0]:.2f}: ray.init {row['init_s']:.2f} s, "
                f"store -> object manager {'?' if wait is None else f'{wait:.3f}'} s",
                flush=True,
            )
    summary = {
        side: {
            "median_init_s": round(statistics.median(r["init_s"] for r in rs), 2),
            "lost_race": sum(1 for r in rs if (r["store_wait_s"] or 0) >= 0.05),
            "starts": len(rs),
        }
        for side, rs in rows.items()
    }
    print(json.dumps({"load_avg": os.getloadavg(), "sides": summary}))


if __name__ == "__main__":
    main()
