"""Stop a real run at instants anchored to its own events, by every route, and check how it ends.

Each case starts `orlhf train-ppo` on the built-in demo (a subprocess in a process group of its own, SIGINT at its
default as from a terminal), waits for its anchor (a terminal line of the start-up, or a phase of a step, a
checkpoint or the export in <save_path>/logs/driver.log, where each phase is traced as it begins), then sends SIGTERM
or SIGINT to the driver alone or to its whole process group, once or twice (the second 0.5 s later). The outcome:

    exit code   128 + the signal (0 where the export finished first)
    line        the last terminal line is the stop's own: where, what is kept, how to continue
    checkpoint  the one the line names is complete (meta.json); a step's first signal keeps that step's
    seconds     from the first signal to the driver's exit, within --stop_grace_s + 15 s (+ slack for a loaded host)
    leftovers   every process of the run's tree, taken just before the signal, is gone once the driver has exited
    no dump     no Python traceback, no Ray C++ stack, no line of another library on the terminal

    python benchmarks/stop_sweep.py                       # the whole sweep: every anchor x signal x target x count
    python benchmarks/stop_sweep.py --anchors ray,train --repeat 3
Prints a table and ends with one JSON line. tests/e2e/test_stop_sweep.py runs a covering subset.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import psutil

ORLHF = str(Path(sys.executable).parent / "orlhf")
GRACE_S = 15.0
BOUND_S = GRACE_S + 15.0  # the documented bound (launch/stop_signals.py: grace + END_S + KILL_S, rounded up)
SLACK_S = 15.0  # a loaded 2-core host: the bound is asserted with this slack, the measured seconds are reported

# anchor -> (where to look, pattern, flags it needs). "term": the terminal's lines; "trace": driver.log's phase trace.
ANCHORS: dict[str, tuple[str, Optional[str], tuple]] = {
    "imports": ("term", None, ()),  # once the process catches SIGTERM: its imports, before any line
    "inputs": ("term", r"\[orlhf\] disk: ", ()),  # the tokenizer and prompts being read
    "ray": ("term", r"\[orlhf\] prompts: ", ()),  # Ray's processes starting
    "groups": ("term", r"\[orlhf\] actor: \d+ rank\(s\), pids", ()),  # the model groups' init
    "engines": ("term", r"\[orlhf\] vllm engines: \d+, pids", ()),  # the engines' start, the weight-sync group
    "generate": ("trace", r"orlhf.trace: step 2: generate$", ()),
    "score": ("trace", r"orlhf.trace: step 2: score$", ()),
    "train": ("trace", r"orlhf.trace: step 2: train$", ()),
    "sync": ("trace", r"orlhf.trace: step 2: sync$", ()),
    "checkpoint": ("trace", r"orlhf.trace: step 2: checkpoint$", ("--save_steps", "1")),
    "export": ("trace", r"orlhf.trace: export$", ("--num_episodes", "1")),
    # a lost rank's restart: the actor's rank is killed once step 2's checkpoint is written (_lose_a_rank)
    "restart": ("term", r"restarting the run's groups", ("--save_steps", "2", "--max_restarts", "1")),
    # a step that outlasts the grace: step 2's reward function sleeps for minutes (user code in the driver's main
    # thread, which no signal interrupts); the run stops with its newest checkpoint once --stop_grace_s is over
    "long-step": (
        "trace",
        r"orlhf.trace: step 2: score$",
        ("--stop_grace_s", "5", "--save_steps", "1", "--remote_rm_url", "{slow_reward}"),
    ),  # fmt: skip
}
SLOW_REWARD = """import time

import torch

calls = []


def reward_func(queries, prompts, labels):
    calls.append(1)
    if len(calls) == 2:
        time.sleep(600)
    return torch.tensor([float("red" in q[len(p):]) for q, p in zip(queries, prompts)])
"""
NEEDS_ENGINES = ("engines",)


@dataclass
class Case:
    anchor: str
    sig: str = "SIGTERM"  # or SIGINT; SIGKILL: only that the run's processes go with the driver
    target: str = "driver"  # or "group"
    times: int = 1

    @property
    def name(self) -> str:
        return f"{self.anchor}-{self.sig[3:].lower()}-{self.target}-x{self.times}"


@dataclass
class Outcome:
    case: Case
    rc: Optional[int] = None
    seconds: Optional[float] = None
    line: str = ""
    checkpoint: Optional[str] = None
    leftovers: list = field(default_factory=list)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def flags_for(case: Case, workdir: Path) -> list[str]:
    """The run's flags: the demo for 50 episodes, without vLLM unless the anchor is its start, and the anchor's own
    (which win)."""
    _, _, extra = ANCHORS[case.anchor]
    flags = {"--num_episodes": "50", "--stop_grace_s": str(GRACE_S)}
    if case.anchor not in NEEDS_ENGINES:
        flags["--vllm_num_engines"] = "0"  # generation in the actor's ranks: a start-up without vLLM's
    slow = workdir / "slow_reward.py"
    slow.write_text(SLOW_REWARD)
    flags.update(dict(zip(extra[::2], (v.format(slow_reward=slow) for v in extra[1::2]))))
    return [x for kv in flags.items() for x in kv]


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_case(case: Case, workdir: Path, timeout: float = 300.0) -> Outcome:
    """One stop, start to finish (the module docstring); never raises for what the run does, says it in problems."""
    workdir.mkdir(parents=True, exist_ok=True)
    save = workdir / case.name
    log = workdir / f"{case.name}.log"
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.Popen(
        [ORLHF, "train-ppo", "--device", "cpu", "--save_path", str(save), *flags_for(case, workdir)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: "group" signals it as a scheduler would
        preexec_fn=_sigint_as_from_a_terminal,
        env=env,
    )
    out = Outcome(case)
    try:
        if not _wait_anchor(case, proc, log, save / "logs" / "driver.log", timeout):
            out.problems.append(f"the anchor never came (rc {proc.poll()}): {_tail(log)}")
            return out
        tree = _tree(proc)
        sig = signal.Signals[case.sig]
        t0 = time.monotonic()
        for i in range(case.times):
            if i:
                time.sleep(0.5)
            _send(proc, sig, case.target)
        try:
            proc.wait(timeout=BOUND_S + 60)
        except subprocess.TimeoutExpired:
            out.problems.append("still running 90 s after the signal")
        out.seconds = round(time.monotonic() - t0, 1)
        out.rc = proc.poll()
        deadline = time.monotonic() + (10 if sig == signal.SIGKILL else 0.5)  # the reaper's end of the cluster
        while time.monotonic() < deadline and any(_running(p) for p in tree):
            time.sleep(0.1)
        out.leftovers = [f"{p.pid}:{_name(p)}" for p in tree if _running(p)]
        if sig == signal.SIGKILL:  # nothing to say for a process killed outright: only what it leaves
            out.problems += [f"left running: {out.leftovers}"] if out.leftovers else []
            return out
        judge(out, log.read_text(errors="replace"), save)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in _tree(proc) if proc.poll() is None else []:
            p.kill()
    return out


def judge(out: Outcome, text: str, save: Path) -> None:
    """What the outcome must be, whatever instant the signal met (the line says which)."""
    case, p = out.case, out.problems
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    out.line = lines[-1] if lines else ""
    sig = case.sig
    stop = re.fullmatch(rf"\[orlhf\] stopped (by|at once by a second) {sig} (.+?): (.*)", out.line)
    done = re.fullmatch(
        rf"\[orlhf\] {sig} (during the export: it finished first|at the end of the run:).* the run is complete.*",
        out.line,
    )
    if stop is None and done is None:
        p.append(f"last line is not the stop's: {out.line!r}")
    want_rc = 0 if done else 128 + int(signal.Signals[sig])
    if out.rc != want_rc:
        p.append(f"rc {out.rc}, expected {want_rc}")
    if out.seconds is not None and out.seconds > BOUND_S + SLACK_S:
        p.append(f"took {out.seconds} s (bound {BOUND_S:g} s)")
    if out.leftovers:
        p.append(f"left running: {out.leftovers}")
    for bad in ("Traceback", "*** SIG", "PC: @", "Failed to connect to GCS"):
        if bad in text:
            p.append(f"the terminal has {bad!r}")
    if stop is not None:
        kept = re.search(r"^checkpoint (\S+) kept;|the newest checkpoint is (\S+);", stop.group(3))
        if kept:
            out.checkpoint = kept.group(1) or kept.group(2)
            if not (Path(out.checkpoint) / "meta.json").exists():
                p.append(f"the line names {out.checkpoint}, which is not a complete checkpoint")
        step = re.fullmatch(r"during (?:the checkpoint of )?step (\d+)", stop.group(2))
        first_kept = stop.group(1) == "by" and step and "did not end within" not in stop.group(3)
        if first_kept and not (out.checkpoint and out.checkpoint.endswith(f"step_{int(step.group(1)):06d}")):
            p.append(f"a first signal during step {step.group(1)} did not keep that step: {out.line!r}")
    orlhf_after = [ln for ln in lines if not ln.startswith("[orlhf] ") and not ln.startswith("ppo:")]
    if orlhf_after:
        p.append(f"lines not orlhf's on the terminal: {orlhf_after[:3]}")


def _wait_anchor(case: Case, proc, log: Path, trace: Path, timeout: float) -> bool:
    where, pattern, _ = ANCHORS[case.anchor]
    if case.anchor == "restart" and not _lose_a_rank(proc, log, trace, timeout):
        return False
    if pattern is None:  # as soon as the process catches SIGTERM: orlhf's first lines of code, then its imports
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            if _catches(proc.pid, signal.SIGTERM):
                return True
            time.sleep(0.002)
        return False
    source = log if where == "term" else trace
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if source.exists() and re.search(pattern, source.read_text(errors="replace"), re.M):
            return True
        time.sleep(0.05)
    return False


def _lose_a_rank(proc, log: Path, trace: Path, timeout: float) -> bool:
    """SIGKILL the actor's rank once step 3 has begun (step 2's checkpoint written): the run restarts from it."""
    deadline = time.monotonic() + timeout
    pid = None
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"actor: \d+ rank\(s\), pids \[(\d+)", log.read_text(errors="replace"))
        started = trace.exists() and "step 3: generate" in trace.read_text(errors="replace")
        if m and started:
            pid = int(m.group(1))
            break
        time.sleep(0.05)
    if pid is None:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler for `sig` (the SigCgt mask of /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    m = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return bool(m and int(m.group(1), 16) >> (int(sig) - 1) & 1)


def _send(proc, sig, target: str) -> None:
    try:
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _tree(proc) -> list:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def _running(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(p) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-1500:] if log.exists() else ""


def all_cases(anchors, sigs=("SIGTERM", "SIGINT"), targets=("driver", "group"), times=(1, 2)) -> list[Case]:
    return [Case(a, s, t, n) for a, s, t, n in itertools.product(anchors, sigs, targets, times)]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", default=",".join(ANCHORS), help="comma-separated, of: " + ",".join(ANCHORS))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--signals", default="SIGTERM,SIGINT")
    ap.add_argument("--targets", default="driver,group")
    ap.add_argument("--times", default="1,2")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    anchors = args.anchors.split(",")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="stop_sweep_"))
    print(f"CPU {cpu_model()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; logs in {workdir}")
    print(f"{'case':<28} {'rc':>4} {'s':>6}  left  line")
    results = []
    for r in range(args.repeat):
        times = tuple(int(n) for n in args.times.split(","))
        for case in all_cases(anchors, args.signals.split(","), args.targets.split(","), times):
            out = run_case(case, workdir / f"r{r}")
            results.append(out)
            line = out.line.removeprefix("[orlhf] ")[:110]
            print(f"{case.name:<28} {out.rc!s:>4} {out.seconds!s:>6}  {len(out.leftovers):>4}  {line}", flush=True)
            for problem in out.problems:
                print(f"    PROBLEM: {problem}", flush=True)
    failed = [o.case.name for o in results if not o.ok]
    secs = [o.seconds for o in results if o.seconds is not None]
    print(
        json.dumps(
            {
                "cases": len(results),
                "failed": failed,
                "max_s": max(secs, default=None),
                "cpu": cpu_model(),
                "load": round(os.getloadavg()[0], 2),
                "outcomes": [
                    {**asdict(o.case), **{k: getattr(o, k) for k in ("rc", "seconds", "line")}} for o in results
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
