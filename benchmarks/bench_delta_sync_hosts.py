"""Full vs delta weight sync where bytes cost: the actor and the engine on two hosts (network namespaces).

    tests/multihost/hosts.py: three namespace hosts on a bridge (veth links); the Ray head and the driver on
    hosts[0], one CPU on each of hosts[1] and hosts[2], so the actor rank and the vLLM engine land apart
    per run (the demo, bf16 engines: --bf16; --actor_learning_rate --lr; --stop_after_steps S), alternating full
    and --vllm_sync_delta:
      link bytes per step   the engine host's veth counters (rx + tx) between two metrics rows: that step's
                            sync plus its prompts and rollouts (a few KB)
      sync seconds          timing/sync of each step (metrics.jsonl)
      held copy             what --vllm_sync_delta keeps (orlhf plan: eP on actor rank 0 and per engine worker)

Root only (network namespaces). Reproduce (2-core CPU; each run starts Ray workers and an engine):
    PYTHONPATH=$PWD python benchmarks/bench_delta_sync_hosts.py --steps 6 --repeats 1
Results: benchmarks/results/2026-12-02-delta-sync-measure.md. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.multihost.hosts import Hosts, can_build_hosts  # noqa: E402

ORLHF = str(Path(sys.executable).parent / "orlhf")


def rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def one_run(hosts, save: Path, steps: int, delta: bool, lr: float) -> dict:
    flags = ["--bf16", "--allow_slow_bf16", "--stop_after_steps", str(steps), "--actor_learning_rate", str(lr)]
    flags += ["--vllm_sync_delta"] if delta else []
    argv = hosts.head.argv(ORLHF, "train-ppo", "--address", hosts.address, "--device", "cpu", "--save_path", str(save))
    log = save.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen([*argv, *flags], stdout=out, stderr=subprocess.STDOUT, env=hosts.env)
        metrics, counted = save / "metrics.jsonl", []
        engine = None
        while proc.poll() is None:
            text = log.read_text()
            if engine is None and "vllm engines: 1, pids [" in text:
                pid = int(text.split("vllm engines: 1, pids [", 1)[1].split("]", 1)[0])
                engine = next((h for h in hosts.hosts if pid in h.pids()), None)
            n = len(rows(metrics))
            if engine is not None and (not counted or n > counted[-1][0]):
                counted.append((n, hosts.link_bytes(engine)))
            time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(log.read_text()[-3000:])
    out = rows(metrics)
    per_step = [b[1] - a[1] for a, b in zip(counted, counted[1:]) if b[0] == a[0] + 1 and a[0] >= 1]
    return {
        "delta": delta,
        "link_bytes_per_step": per_step,
        "sync_s": [round(r["timing/sync"], 4) for r in out[1:]],
        "gap": max(r["engine_logprob_gap"] for r in out),
        "steps": len(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-5, help="--actor_learning_rate (the demo's preset: 5e-4)")
    ap.add_argument("--repeats", type=int, default=1, help="full/delta pairs, interleaved")
    args = ap.parse_args()
    why = can_build_hosts()
    if why is not None:
        sys.exit(f"cannot build hosts here: {why}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp, Hosts(3) as hosts:
        h0, h1, h2 = hosts.hosts
        hosts.start_ray(h0, num_cpus=0)
        hosts.start_ray(h1, num_cpus=1)
        hosts.start_ray(h2, num_cpus=1)
        for k in range(args.repeats):
            for delta in (False, True):
                r = one_run(hosts, Path(tmp) / f"run-{k}-{int(delta)}", args.steps, delta, args.lr)
                print(json.dumps(r), flush=True)
                runs.append(r)
    print("| sync | link bytes per step (median) | sync s per step (median) | max engine gap |")
    print("|---|---|---|---|")
    summary = {}
    for mode in (False, True):
        got = [r for r in runs if r["delta"] == mode]
        b = statistics.median(x for r in got for x in r["link_bytes_per_step"])
        s = statistics.median(x for r in got for x in r["sync_s"])
        g = max(r["gap"] for r in got)
        name = "delta" if mode else "full"
        summary[name] = {"link_bytes": b, "sync_s": s, "gap": g}
        print(f"| {name} | {b:,.0f} | {s:.3f} | {g:.2e} |")
    print(json.dumps({"bench": "delta_sync_hosts", "steps": args.steps, "lr": args.lr, **summary}))


if __name__ == "__main__":
    main()
