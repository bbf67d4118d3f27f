"""The memory of a run's process tree, by group, while it runs; and ending that tree by process id.

    python benchmarks/proctree.py OUT_DIR -- CMD...   run CMD sampled; one JSON line of peak RSS per group

    TreeSampler(pid, metrics.jsonl).start()   every 0.25 s: RSS of pid and all its descendants, summed per group
                                              (rss_group: driver, Ray actor class, hybrid ranks, Ray system, other),
                                              each group's peak sum kept; metrics rows' arrival times noted,
                                              with the CPU seconds each group had used by then (cpu_at_rows)
    kill_tree(pid)                            terminate, then kill, exactly the processes of that tree

Groups come from command lines: Ray titles its workers "ray::<Class>[.<method>]", torch.multiprocessing ranks run
"spawn_main". A fork not yet exec'd has its parent's command line and shares its pages: it is skipped, or every
subprocess a rank starts would count that rank twice.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

# RSS groups, in table order. Ray's own actors (IDLE workers, dashboard and runtime-env agents) count as Ray system.
RSS_GROUPS = ("driver", "RankActor", "EngineActor", "hybrid ranks", "ray system", "other")
_RAY_SYSTEM = re.compile(r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|runtime_env|ray/_private")


def rss_group(pid: int, cmd: list[str], root_pid: int) -> str:
    """Which group a process of the run's tree counts under: by Ray actor class, else by command line."""
    if pid == root_pid:
        return "driver"  # orlhf's controller; the hybrid baseline's only rank with --world_size 1
    head = cmd[0] if cmd else ""
    if head.startswith("ray::"):  # Ray's process titles: ray::RankActor, ray::EngineActor.generate, ray::IDLE
        cls = re.split(r"[.\s(]", head[5:], maxsplit=1)[0]
        if cls == "CpuRankActor":  # CPU runs' rank processes (orlhf/cpu/rank_actor.py): the same group
            return "RankActor"
        return cls if cls in ("RankActor", "EngineActor") else "ray system"
    text = " ".join(cmd)
    if "spawn_main" in text:
        return "hybrid ranks"  # torch.multiprocessing ranks of the baseline (--world_size > 1)
    return "ray system" if _RAY_SYSTEM.search(text) else "other"


class TreeSampler(threading.Thread):
    """Peak RSS per group (the peak of each group's sum, sampled every `every` s) and metrics-row arrival times."""

    def __init__(self, pid: int, metrics: Path, every: float = 0.25, marker: Path | None = None):
        super().__init__(daemon=True)
        self.pid, self.metrics, self.every, self.marker = pid, metrics, every, marker
        self.peak: dict[str, float] = {}  # group -> bytes
        self.procs: dict[str, int] = {}  # group -> most processes seen at once
        self.peak_total = 0.0
        self.other: tuple[float, str] = (0.0, "")  # the largest "other" process seen: (RSS, command line)
        self.row_times: list[float] = []
        self.cpu_at_rows: list[dict[str, float]] = []  # per metrics row: group -> CPU seconds used so far
        self.cpu_at_marker: dict[str, float] | None = None  # group -> CPU seconds when `marker` appeared
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (group, user + system seconds when last seen)
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        next_rss = 0.0
        while not self.done.is_set():
            now = time.monotonic()
            if self.marker is not None and self.cpu_at_marker is None and self.marker.exists():
                self.sample(root, psutil)  # e.g. orlhf's startup.json, written as step 1 starts
                self.cpu_at_marker = self.cpu_by_group()
            if self.metrics.exists():
                with open(self.metrics) as f:
                    n = sum(1 for line in f if line.strip())
                if n > len(self.row_times):
                    self.row_times += [now] * (n - len(self.row_times))
                    self.sample(root, psutil)
                    self.cpu_at_rows += [self.cpu_by_group()] * (n - len(self.cpu_at_rows))
            if now >= next_rss:
                next_rss = now + self.every
                self.sample(root, psutil)
            self.done.wait(0.05)

    def sample(self, root, psutil) -> None:
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        cmds = {}
        for p in procs:
            try:
                cmds[p.pid] = (p.ppid(), p.cmdline())
            except psutil.Error:
                continue
        for p in procs:
            if p.pid not in cmds:
                continue
            ppid, cmd = cmds[p.pid]
            if ppid in cmds and cmds[ppid][1] == cmd:
                continue  # a fork not yet exec'd (e.g. a subprocess being started): its pages are its parent's
            try:
                group, rss = rss_group(p.pid, cmd, self.pid), p.memory_info().rss
                t = p.cpu_times()
                self._cpu[p.pid] = (group, t.user + t.system)
            except psutil.Error:
                continue
            sums[group] = sums.get(group, 0.0) + rss
            if group == "other" and rss > self.other[0]:
                self.other = (rss, " ".join(cmd)[:120])
            counts[group] = counts.get(group, 0) + 1
        for g, v in sums.items():
            self.peak[g] = max(self.peak.get(g, 0.0), v)
            self.procs[g] = max(self.procs.get(g, 0), counts[g])
        self.peak_total = max(self.peak_total, sum(sums.values()))

    def cpu_by_group(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far per group; a process that ended counts as last seen."""
        out: dict[str, float] = {}
        for group, seconds in self._cpu.values():
            out[group] = out.get(group, 0.0) + seconds
        return out


def kill_tree(pid: int) -> None:
    """The run's own processes, by id: children first collected, then terminated, then killed if still there."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def run_sampled(
    cmd: list[str], cwd, log_path: Path, env: dict, timeout: float, marker: str | None = None
) -> tuple[object, "TreeSampler"]:
    """Run `cmd` with its output in `log_path`, its process tree sampled (memory, CPU, metrics-row arrival times:
    TreeSampler reads <log_path's folder>/metrics.jsonl; CPU seconds per group also when the file `marker`
    appears in that folder). Returns (exit code, or "timed out after N s", sampler).
    A run past `timeout` has its whole tree killed."""
    import subprocess

    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        sampler = TreeSampler(
            proc.pid, log_path.parent / "metrics.jsonl", marker=log_path.parent / marker if marker else None
        )
        sampler.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            rc = f"timed out after {timeout:.0f} s ({proc.wait()})"
        finally:
            sampler.done.set()
            sampler.join()
    return rc, sampler


def main() -> None:
    """`python benchmarks/proctree.py OUT_DIR -- CMD...`: run CMD; print each group's peak RSS (MiB), one JSON line."""
    import json
    import os
    import sys

    out, cmd = Path(sys.argv[1]), sys.argv[sys.argv.index("--") + 1 :]
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    rc, s = run_sampled(cmd, os.getcwd(), out / "run.log", dict(os.environ), 3600)
    peaks = {g: round(s.peak[g] / 2**20) for g in RSS_GROUPS if g in s.peak}
    print(
        json.dumps(
            {
                "rc": rc,
                "peak_rss_mib": peaks,
                "processes": s.procs,
                "peak_total_mib": round(s.peak_total / 2**20),
                "load_avg_start": load0,
                "load_avg_end": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
