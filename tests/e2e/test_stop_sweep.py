"""Stops of a real run at instants anchored to its own events, by every route (benchmarks/stop_sweep.py runs the
whole matrix and says how): each start-up phase, each phase of a step, a checkpoint and the export, once each, the
signal (SIGTERM, SIGINT), the target (the driver alone, its whole process group) and the count (once, twice) rotated
so that every value meets several phases. Each asserts the outcome, never the timing within the bound: the exit code,
the stop's line as the last terminal line, the checkpoint it names complete (a step's first signal keeps that step),
nothing of the run left running, no traceback or C++ stack, no other library's line on the terminal."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stop_sweep import Case, run_case  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.stops]

CASES = [
    Case("imports", "SIGINT", "group", 1),
    Case("inputs", "SIGTERM", "driver", 2),
    Case("ray", "SIGTERM", "group", 1),  # once: rc 15 and no line (Ray's handler), or 60 s on a dead GCS
    Case("groups", "SIGINT", "driver", 1),
    Case("engines", "SIGTERM", "group", 2),
    Case("generate", "SIGINT", "group", 1),  # a terminal's Ctrl-C
    Case("score", "SIGTERM", "driver", 2),
    Case("train", "SIGTERM", "group", 1),  # `timeout`, SLURM's scancel
    Case("sync", "SIGINT", "driver", 1),
    Case("checkpoint", "SIGTERM", "group", 2),
    Case("export", "SIGINT", "driver", 1),
    Case("long-step", "SIGTERM", "group", 1),  # the step outlasts --stop_grace_s: the newest checkpoint is kept
    Case("restart", "SIGINT", "driver", 1),  # a lost rank's restart under way
    Case("train", "SIGKILL", "driver", 1),  # nothing handles it: the local cluster's processes go with the driver
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_stop_ends_the_run_with_its_line_and_nothing_left(case, tmp_path):
    out = run_case(case, tmp_path)
    assert out.ok, f"{case.name}: {out.problems}\nrc {out.rc}, {out.seconds} s, last line: {out.line}"
