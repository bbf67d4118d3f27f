"""A CPU engine's process keeps freed memory for reuse, as a rank's does (cpu/memory.py): CpuTuning.engine_start
sets it before vLLM starts, so the blocks each weight sync allocates afresh (received buckets, re-packed weights)
come back from the heap instead of as new pages. The engine's own start is stood in for; what the process does
after it is test_keep_freed_memory.py's pattern (blocks allocated, written and freed, again and again), from
glibc's starting mmap threshold held fixed, which engine_start must undo."""

import subprocess
import sys

import pytest

CHILD = """
import ctypes, resource, sys, torch
from orlhf.cpu.tuning import CpuTuning
assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: every 6 MB block mmapped and returned

def blocks(*_):  # in place of the engine's start: the process's work after it
    def sync():
        live = [torch.ones(64, 25, 965) for _ in range(4)]
        del live
    for _ in range(3):
        sync()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        sync()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "engine":
    CpuTuning._start_engine = blocks
    print(CpuTuning().engine_start(None, None))
else:
    print(blocks())
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_an_engine_reuses_what_it_freed():
    plain, engine = _faults("plain"), _faults("engine")
    assert plain > 50_000, plain  # 80 x 6 MB of fresh pages: ~120k faults
    assert engine < plain / 20, (engine, plain)
