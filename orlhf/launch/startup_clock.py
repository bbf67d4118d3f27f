"""Where start-up time goes: a clock that launch/run.py marks after each phase, printed once before the first step.

    process start (the OS's record) --mark("imports")--> ... --mark("weight sync")--> report():
    "start-up <total> s to the first step: imports <s>, prompts <s>, ray <s>, placement <s>, ..."

Phases are the gaps between consecutive marks, so they add up to the total; a mark whose work overlapped
another's (engines start while the model groups start) shows only the time it added.
"""

from __future__ import annotations

import logging
import os
import time

from orlhf.storage.logs import TRACE

log = logging.getLogger("orlhf")


def process_start_time() -> float:
    """time.time() when this process started (from /proc on Linux; now elsewhere)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # psutil missing or no /proc: count from the first mark's caller instead
        return time.time()


class StartupClock:
    def __init__(self, start: float | None = None):
        self.start = process_start_time() if start is None else start
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """`phase` ended now."""
        self.marks.append((phase, time.time()))
        logging.getLogger(TRACE).info("start-up: %s done", phase)

    def phases(self) -> dict[str, float]:
        out, last = {}, self.start
        for name, t in self.marks:
            out[name] = out.get(name, 0.0) + t - last
            last = t
        return out

    @property
    def total(self) -> float:
        return (self.marks[-1][1] if self.marks else time.time()) - self.start

    def save(self, path) -> None:
        """The phases as JSON (benchmarks read it); best effort: a start-up figure must not stop a run."""
        import json

        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                json.dump({"total_s": self.total, "phases_s": self.phases()}, f)
        except OSError as e:
            log.warning("could not write %s: %s", path, e)

    def report(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases().items())
        return f"start-up {self.total:.1f} s to the first step: {parts} (seconds)"
