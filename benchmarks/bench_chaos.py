"""Chaos: the demo for 100+ steps while random faults hit it, against the same run undisturbed.

    two runs of `orlhf train-ppo` (the demo; sync mode; rewards from `orlhf serve-rm` over HTTP; checkpoints every
    --save_steps on a small tmpfs of their own), the second one with faults, each at a random step (at least --gap
    steps apart) and a random moment in it (seeded by --seed):
      engine_kill   kill -9 the vLLM engine                 replaced in place, its share of the step generated again
      rank_kill     kill -9 the actor's rank                the groups start again from the newest checkpoint
      engine_stop   SIGSTOP the engine (past --hang_timeout_s)   counted lost, replaced in place
      rank_stop     SIGSTOP the actor's rank (past --hang_timeout_s)   counted lost, the groups start again
      reward_drop   the HTTP reward server killed, back after --reward_down_s   retried within --reward_timeout_s
      disk_full     the checkpoint filesystem filled until --save_steps more steps are logged, then freed
    -> per fault: the step it hit, whether the run's terminal said what happened, its overhead (the time to the
       step --gap/2 steps after the one it hit, less what those steps take undisturbed); the wall-clock difference of
       the two runs per fault; the run's exit code, every step logged once, which metrics equal the undisturbed
       run's at every step and which do not, the final actor's tensors against the undisturbed one's; a table and
       one JSON line

Sync mode is deterministic by design (every request sampled from its own seed, a restart resumes the checkpoint's
RNG and prompt order, a replaced engine regenerates its share with the same seeds), so the trained numbers and the
final weights should be equal; times, restart counters and the engines' log-prob gap are not compared.

Needs root (it mounts a tmpfs for the checkpoints). Reproduce (2-core CPU; two runs of 112 steps, ~6 min):
    flock /tmp/orlhf-heavy.lock .venv/bin/python benchmarks/bench_chaos.py
    flock /tmp/orlhf-heavy.lock .venv/bin/python benchmarks/bench_chaos.py --kinds engine_kill,reward_drop --faults 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("engine_kill", "rank_kill", "engine_stop", "rank_stop", "reward_drop", "disk_full")
UNCOMPARED = re.compile(r"^(timing/.*|step_s|samples_per_s|engine_restarts|run_restarts|engine_logprob_gap)$")
SAID = {  # what the run's terminal says about each fault
    "engine_kill": r"vllm engine 0 died during",
    "engine_stop": r"vllm engine 0 stopped answering health checks",
    "rank_kill": r"rank 0 lost .*; restarting the run's groups",
    "rank_stop": r"rank 0 lost .*; restarting the run's groups",
    "reward_drop": r"reward server \S+: attempt 1 of \d+ failed",
    "disk_full": r"no space left on",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RewardServer:
    """`orlhf serve-rm` on the demo's reward function, at a fixed port so the run's URL stays valid across drops."""

    def __init__(self, reward_fn: str, port: int, log: Path):
        self.reward_fn, self.port, self.log, self.proc = reward_fn, port, log, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/get_reward"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "orlhf.cli", "serve-rm", self.reward_fn, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the reward server did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Run:
    """One train-ppo subprocess: its log, metrics rows and the arrival time of every new step."""

    def __init__(self, name: str, work: Path, flags: list[str]):
        self.save, self.log = work / name, work / f"{name}.log"
        cmd = [sys.executable, "-m", "orlhf.cli", "train-ppo", "--device", "cpu", "--save_path", str(self.save)]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd + flags, cwd=ROOT, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        self.new_step_at: dict[int, float] = {}  # step -> when a row of it first appeared
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while self.proc.poll() is None:
            steps = [r["step"] for r in self.rows()]
            for s in steps:
                self.new_step_at.setdefault(s, time.monotonic())
            time.sleep(0.1)

    def rows(self) -> list[dict]:
        try:
            lines = (self.save / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                break  # a row being written
        return out

    def top(self) -> int:
        return max(self.new_step_at, default=0)

    def wait_top(self, step: int, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while self.top() < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or stalled before step {step}: {self.text()[-3000:]}")
            time.sleep(0.1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pid(self, role: str) -> int:
        """The newest pid the log names for the engine or the actor's rank."""
        if role == "engine":
            pattern = r"vllm engines: 1, pids \[(\d+)\]|vllm engine 0 replaced in [\d.]+ s \(pid (\d+)\)"
        else:
            pattern = r"actor: 1 rank\(s\), pids \[(\d+)\]"
        matches = list(re.finditer(pattern, self.text()))
        return int(next(g for g in matches[-1].groups() if g))

    def wait(self, timeout: float = 3600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def plan(kinds: list[str], n: int, steps: int, gap: int, seed: int) -> list[tuple[int, str, float]]:
    """(step, kind, moment) for n faults, kinds in turn (shuffled), steps at least `gap` apart; the moment is the
    share of an undisturbed step waited after the step before it was logged."""
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(order)
    first, last = 3, steps - 2
    if (n - 1) * gap > last - first:
        raise SystemExit(f"{n} faults {gap} steps apart do not fit in steps {first}-{last}: fewer or closer faults")
    slack = (last - first) - (n - 1) * gap
    cuts = sorted(rng.randint(0, slack) for _ in range(n))
    return [(first + i * gap + cut, kind, rng.random()) for i, (cut, kind) in enumerate(zip(cuts, order))]


def fill(folder: Path) -> Path:
    """A file that takes every free byte of `folder`'s filesystem."""
    filler = folder / "chaos-filler.bin"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        except OSError:
            pass
    return filler


def inject(run: Run, step: int, kind: str, delay: float, server: RewardServer, args, ckpt: Path) -> dict:
    """Wait for `step` to begin (the row before it logged), `delay` s more, then the fault; returns its record (`at`:
    the step in progress when it hit)."""
    run.wait_top(step - 1)
    time.sleep(delay)
    t, top = time.monotonic(), run.top()
    record = {"kind": kind, "step": step, "at": top + 1, "delay_s": round(delay, 2)}
    if kind in ("engine_kill", "rank_kill", "engine_stop", "rank_stop"):
        pid = run.pid("engine" if kind.startswith("engine") else "actor")
        os.kill(pid, signal.SIGSTOP if kind.endswith("stop") else signal.SIGKILL)
        record["pid"] = pid
    elif kind == "reward_drop":
        server.kill()
        time.sleep(args.reward_down_s)
        server.start()
    else:  # disk_full: held until --save_steps more steps were logged, so a save met it
        filler = fill(ckpt)
        run.wait_top(top + args.save_steps + 1)
        filler.unlink()
    record["t"] = t
    return record


def overhead(run: Run, record: dict, median_step: float, window: int) -> float:
    """Seconds from the fault to the first log of step at + window (`at`: the step it hit), less what `window`
    undisturbed steps take: the time the fault cost, restarts and steps trained again included (a fault may be
    noticed a step after it hit, so the window spans a few steps)."""
    end = run.new_step_at.get(record["at"] + window)
    if end is None:
        return float("nan")
    return max(0.0, end - record["t"] - window * median_step)


def compare(clean: list[dict], chaos: list[dict]) -> dict:
    keys = sorted(k for k in clean[0] if not UNCOMPARED.match(k) and all(k in r for r in clean + chaos))
    equal = [k for k in keys if [r[k] for r in clean] == [r[k] for r in chaos]]
    differ = {
        k: max((abs(a[k] - b[k]) for a, b in zip(clean, chaos) if isinstance(a[k], (int, float))), default=None)
        for k in keys
        if k not in equal
    }
    return {"equal": equal, "differ_max_abs": differ}


def weights_diff(a: Path, b: Path) -> dict:
    from safetensors.numpy import load_file

    ta = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    tb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(f).items()}
    same = [k for k in ta if k in tb and ta[k].shape == tb[k].shape and (ta[k] == tb[k]).all()]
    worst = max((float(abs(ta[k].astype("float64") - tb[k]).max()) for k in ta if k in tb), default=float("nan"))
    return {"tensors": len(ta), "bitwise_equal": len(same), "max_abs_diff": worst, "same_names": set(ta) == set(tb)}


def flags_for(args, ckpt: Path, url: str, faults: list) -> list[str]:
    rank_faults = sum(k in ("rank_kill", "rank_stop") for _, k, _ in faults)
    engine_faults = sum(k in ("engine_kill", "engine_stop") for _, k, _ in faults)
    return [
        *("--rollout_batch_size", "32", "--train_batch_size", "32", "--num_episodes", str(args.episodes)),
        *("--save_steps", str(args.save_steps), "--ckpt_path", str(ckpt), "--remote_rm_url", url),
        *("--max_restarts", str(rank_faults + 1), "--max_engine_restarts", str(engine_faults + 1)),
        *("--hang_timeout_s", str(args.hang_timeout_s)),
    ]


def mount_tmpfs(folder: Path, mb: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(folder)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--episodes", type=int, default=7, help="the demo's 512 prompts / 32 = 16 steps an episode")
    ap.add_argument("--save_steps", type=int, default=4)
    ap.add_argument("--gap", type=int, default=8, help="least steps between two faults")
    ap.add_argument("--hang_timeout_s", type=float, default=10.0)
    ap.add_argument("--reward_down_s", type=float, default=15.0)
    ap.add_argument("--ckpt_mb", type=int, default=160, help="size of the checkpoints' tmpfs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/orlhf-chaos")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    steps = 512 // 32 * a.episodes
    faults = plan(a.kinds.split(","), a.faults, steps, a.gap, a.seed)
    server = RewardServer(str(demo.reward_fn), free_port(), work / "reward_server.log")
    mounts = [work / "clean-ckpt", work / "chaos-ckpt"]
    result: dict = {"bench": "chaos", "steps": steps, "planned": [f"{k}@{s}" for s, k, _ in faults]}
    try:
        for m in mounts:
            mount_tmpfs(m, a.ckpt_mb)
        server.start()
        clean = Run("clean", work, flags_for(a, mounts[0], server.url, faults))
        result["clean_exit"] = clean.wait()
        clean_rows = clean.rows()
        result["clean_wall_s"] = time.monotonic() - clean.t0
        median_step = statistics.median(r["step_s"] for r in clean_rows)
        chaos = Run("chaos", work, flags_for(a, mounts[1], server.url, faults))
        records = []
        for step, kind, moment in faults:
            try:
                records.append(inject(chaos, step, kind, moment * median_step, server, a, mounts[1]))
            except RuntimeError as e:
                records.append({"kind": kind, "step": step, "not_injected": str(e)[:300]})
                break
        result["chaos_exit"] = chaos.wait()
        result["chaos_wall_s"] = time.monotonic() - chaos.t0
        text, rows = chaos.text(), chaos.rows()
        for r in records:
            if "t" in r:
                r["overhead_s"] = round(overhead(chaos, r, median_step, max(1, a.gap // 2)), 1)
                r["said"] = bool(re.search(SAID[r["kind"]], text))
                r.pop("t")
        result.update(
            faults=records,
            median_step_s=median_step,
            overhead_per_fault_s=(result["chaos_wall_s"] - result["clean_wall_s"]) / max(1, len(records)),
            steps_logged=[r["step"] for r in rows] == list(range(1, steps + 1)),
            metrics=compare(clean_rows, rows) if len(rows) == len(clean_rows) else "row counts differ",
            weights=weights_diff(clean.save / "actor", chaos.save / "actor") if result["chaos_exit"] == 0 else None,
            restarts=(chaos.save / "restarts.jsonl").read_text().splitlines()
            if (chaos.save / "restarts.jsonl").exists()
            else [],
            load_avg=os.getloadavg(),
            step_logged_at_s={s: round(t - chaos.t0, 2) for s, t in sorted(chaos.new_step_at.items())},
        )
    finally:
        server.kill()
        for f in result.get("faults", []):  # a stopped process the run did not end itself
            if f.get("pid") and f["kind"].endswith("stop"):
                try:
                    os.kill(f["pid"], signal.SIGKILL)
                except OSError:
                    pass
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], check=False)
    report(result)


def report(r: dict) -> None:
    print(f"{'fault':12} {'step':>4} {'said':>5} {'overhead s':>10}")
    for f in r.get("faults", []):
        shown = "not injected" if "not_injected" in f else f"{str(f['said']):>5} {f['overhead_s']:10.1f}"
        print(f"{f['kind']:12} {f.get('at', f['step']):4d} {shown}")
    print(
        f"clean: exit {r.get('clean_exit')}, {r.get('clean_wall_s', 0):.0f} s; chaos: exit {r.get('chaos_exit')}, "
        f"{r.get('chaos_wall_s', 0):.0f} s ({r.get('overhead_per_fault_s', 0):.1f} s more per fault); every step "
        f"logged once: {r.get('steps_logged')}"
    )
    print(f"metrics: {r.get('metrics')}")
    print(f"final actor: {r.get('weights')}")
    print(json.dumps(r, default=str))


if __name__ == "__main__":
    main()
