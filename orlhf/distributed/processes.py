"""The processes a run started, ended together when a signal stops it (launch/stop_signals.py); the normal end of a
run's local Ray cluster is ray_start.end_ray."""

from __future__ import annotations

from orlhf.distributed.ray_start import wait_gone


def end_descendants(wait_s: float) -> None:
    """Every process this one started, and theirs (the local Ray cluster, its workers, vLLM's engines and what they
    started), taken at once so that none escapes by being orphaned on the way: SIGTERM, then SIGKILL to what is left
    after half of `wait_s`, then up to the other half for them to go."""
    try:
        import psutil

        tree = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or this process is going: nothing to end
        return
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
