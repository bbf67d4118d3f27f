"""The lifetime of the processes a run starts: the local Ray cluster's in a process group of their own, ended with the
driver however it ends (own_process_group), and every one of them ended together when a signal stops the run at once
(end_descendants, launch/stop_signals.py); the normal end of a run's local cluster is ray_start.end_ray."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Optional

from orlhf.distributed.ray_start import wait_gone


def end_descendants(wait_s: float, spare: tuple = ()) -> list:
    """Every process this one started, and theirs (the local Ray cluster, its workers, vLLM's engines and what they
    started), taken at once so that none escapes by being orphaned on the way: SIGTERM, then SIGKILL to what is left
    after half of `wait_s`, then up to the other half for them to go. Those named in `spare` are left running and
    returned (psutil.Process), for the caller to end last."""
    try:
        import psutil

        tree = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or this process is going: nothing to end
        return []
    spared = [p for p in tree if _name(p) in spare]
    tree = [p for p in tree if p not in spared]
    for p in tree:
        try:
            p.terminate()
        except psutil.Error:
            pass
    left = wait_gone(tree, wait_s / 2)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_gone(left, wait_s / 2)
    return spared


def _name(p) -> str:
    try:
        return p.name()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return ""


@contextmanager
def own_process_group():
    """The local cluster's processes (the GCS, the raylet, and through the raylet every worker, agent and engine)
    start in one process group of their own: a signal to the driver's group (a terminal's Ctrl-C, `timeout`, SLURM's
    scancel) then reaches the driver only, which decides how the run stops while its cluster is still up, instead of
    waiting on a GCS the same signal killed. Their lifetime stays the driver's: Ray's reaper process
    (ray_process_reaper), started in that group with a pipe from this process, ends the whole group when the pipe
    closes, i.e. when the driver exits however it exits (SIGKILL included) or end_ray closes it."""
    global _REAPER
    from ray._private import services

    original, group = services.ConsolePopen, []

    class GroupPopen(original):
        def __init__(self, *args, **kwargs):
            ray_preexec = kwargs.get("preexec_fn")
            target = group[0] if group else 0  # the first process leads the group

            def preexec():
                os.setpgid(0, target)
                if ray_preexec is not None:
                    ray_preexec()

            kwargs["preexec_fn"] = preexec
            super().__init__(*args, **kwargs)
            if not group:
                group.append(self.pid)

    services.ConsolePopen = GroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = original
    if group:
        _REAPER = subprocess.Popen(
            [sys.executable, "-m", "ray._private.ray_process_reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.setpgid(0, group[0]),
        )


_REAPER: Optional[subprocess.Popen] = None  # ends the local cluster's process group when this process goes


def end_reaper() -> None:
    """End the reaper. With the cluster's group already empty (end_ray waited for every process it knew of), a
    SIGTERM ends the reaper alone, at once; otherwise its pipe is closed and it ends what is left of the group (a
    SIGTERM, a second's grace, a SIGKILL), then itself."""
    global _REAPER
    if _REAPER is None:
        return
    reaper, _REAPER = _REAPER, None
    if _group_members_besides(reaper.pid):
        reaper.stdin.close()
    else:
        reaper.terminate()  # before its pipe closes the reaper has no SIGTERM handler: it exits, and only it
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()


def _group_members_besides(pid: int) -> bool:
    """Whether a process other than `pid` is left in `pid`'s process group (True when it cannot tell)."""
    try:
        import psutil

        group = os.getpgid(pid)
        for p in psutil.process_iter():
            try:
                if p.pid != pid and os.getpgid(p.pid) == group:
                    return True
            except (ProcessLookupError, PermissionError):
                continue
        return False
    except Exception:  # noqa: BLE001 - no psutil, or the reaper gone: let the pipe decide
        return True
