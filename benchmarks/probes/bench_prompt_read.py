"""Big prompt files: what reading them costs a run before Ray starts (launch/run_inputs.load_prompts on the demo's
tokenizer and flags), and with --run a whole `orlhf train-ppo` start-up on them.

    cases (generated under --workdir, deleted after unless --keep):
      long      10,000 rows, every other one 20,000 words (~564 MB), the rest short: the long ones are all skipped
      medium    1,000 rows, the same mix (~57 MB)
      million   1,000,000 short rows (~80 MB), all used
    read    a child process: tokenizer, then load_prompts; the seconds to the bar's first draw (from the start of
            the read), the read's seconds, the child's peak RSS (ru_maxrss), prompts kept
    --run   `orlhf train-ppo --prompt_data FILE --stop_after_steps 1` (the demo otherwise): the driver's peak RSS
            (VmHWM, polled), start-up phases from startup.json, wall seconds to the end
    -> a table, and one final JSON line

Reproduce (2-core CPU; read: ~1-2 min for all cases; --run adds a demo start-up and one step per case):
    flock /tmp/orlhf-heavy.lock .venv/bin/python benchmarks/probes/bench_prompt_read.py
    flock /tmp/orlhf-heavy.lock .venv/bin/python benchmarks/probes/bench_prompt_read.py --cases long,million --run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CASES = {"long": (10_000, 20_000), "medium": (1_000, 20_000), "million": (1_000_000, 0)}  # rows, long rows' words
WORDS = "red green blue cyan magenta short read bear sixteen window lavender bronze the a of and sky river".split()


def write_case(path: Path, rows: int, long_words: int, seed: int = 0) -> None:
    """`rows` demo-like rows; with long_words, every other row is that many words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(rows):
            n = long_words if long_words and i % 2 else rng.randint(4, 9)
            text = "say colors: " + " ".join(rng.choice(WORDS) for _ in range(n))
            f.write(json.dumps({"prompt": text, "label": "colors"}) + "\n")


def child_read(path: str) -> None:
    """In the child: the demo's tokenizer and flags, then load_prompts on `path`; one JSON line on stdout."""
    import resource

    from orlhf.config.flags import build_config
    from orlhf.config.resolve import resolve_demo
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.launch.run_inputs import load_prompts

    cfg = resolve_demo(build_config({"prompt_data": path}, {"prompt_data"}))
    tok = load_tokenizer(cfg.data.pretrain)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"READ_START {time.time()}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    prompts = load_prompts(cfg, tok)
    out = {
        "read_s": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_read_mb": rss0,
        "prompts": len(prompts),
    }
    print(json.dumps(out), flush=True)


def watch_stderr(proc: subprocess.Popen, seen: dict) -> None:
    """Note when the child starts reading and when its bar first draws ("prompts <file>")."""
    buf = b""
    while True:
        chunk = proc.stderr.read1(4096)
        if not chunk:
            return
        buf = (buf + chunk)[-4096:]
        if "start" not in seen and b"READ_START " in buf:
            seen["start"] = float(buf.split(b"READ_START ")[1].split(b"\n")[0])
        if "bar" not in seen and b"prompts " in buf and b"\r" in buf:
            seen["bar"] = time.time()


def measure_read(path: Path) -> dict:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    seen: dict = {}
    watcher = threading.Thread(target=watch_stderr, args=(proc, seen), daemon=True)
    watcher.start()
    out = proc.stdout.read().decode()
    proc.wait()
    watcher.join(5)
    if proc.returncode != 0:
        raise RuntimeError(f"the read failed (exit {proc.returncode}): {out[-2000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["first_progress_s"] = seen["bar"] - seen["start"] if "bar" in seen and "start" in seen else None
    return result


def vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure_run(path: Path, workdir: Path) -> dict:
    """A whole train-ppo start-up and one step on the file: the driver's peak RSS and the start-up's phases."""
    save = workdir / "run"
    shutil.rmtree(save, ignore_errors=True)
    cmd = [sys.executable, "-m", "orlhf.cli", "train-ppo", "--device", "cpu", "--save_path", str(save)]
    cmd += ["--prompt_data", str(path), "--stop_after_steps", "1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0.0
    while proc.poll() is None:
        peak = max(peak, vm_hwm_mb(proc.pid) or 0.0)
        time.sleep(0.2)
    err = proc.stderr.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"train-ppo failed (exit {proc.returncode}): {err[-3000:]}")
    startup = json.loads((save / "startup.json").read_text())
    lines = [line for line in err.splitlines() if line.startswith("[orlhf] prompts:")]
    return {
        "driver_peak_rss_mb": peak,
        "startup_s": startup["total_s"],
        "phases_s": {k: round(v, 1) for k, v in startup["phases_s"].items()},
        "wall_s": time.perf_counter() - t0,
        "prompts_line": lines[0] if lines else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="long,medium,million")
    ap.add_argument("--run", action="store_true", help="also a whole train-ppo start-up and one step per case")
    ap.add_argument("--workdir", default="/tmp/orlhf-bench-prompts")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_read(a.child)
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for name in a.cases.split(","):
            path = workdir / f"{name}.jsonl"
            write_case(path, *CASES[name])
            row = {"file_mb": path.stat().st_size / 2**20, "rows": CASES[name][0], **measure_read(path)}
            if a.run:
                row["run"] = measure_run(path, workdir)
            results[name] = row
            path.unlink()
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"{'case':8} {'file MB':>8} {'rows':>9} {'kept':>8} {'bar s':>6} {'read s':>7} {'peak MB':>8}  run")
    for name, r in results.items():
        run = r.get("run")
        shown = f"driver peak {run['driver_peak_rss_mb']:.0f} MB, start-up {run['startup_s']:.1f} s" if run else "-"
        bar = f"{r['first_progress_s']:.1f}" if r["first_progress_s"] is not None else "-"
        print(
            f"{name:8} {r['file_mb']:8.0f} {r['rows']:9d} {r['prompts']:8d} {bar:>6} {r['read_s']:7.1f} "
            f"{r['peak_rss_mb']:8.0f}  {shown}"
        )
    print(json.dumps({"bench": "prompt_read", "load_avg": os.getloadavg(), "cores": os.cpu_count(), **results}))


if __name__ == "__main__":
    main()
