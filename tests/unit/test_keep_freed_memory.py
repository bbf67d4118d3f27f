"""cpu/memory.keep_freed_memory: freed 6 MB tensors come back from the heap, not as fresh pages; on a rank's compute
thread (not the main thread) blocks above a thread arena's 64 MiB heap too, in a process started with
cluster_env(); release_freed_memory gives what it kept back to the OS.

Both cases start by holding glibc's starting mmap threshold (128 KiB) fixed, and keep_freed_memory must undo
that. Left alone, glibc raises the threshold after the first freed mmapped block and may then keep or trim the
heap top depending on the layout: a plain process gave 0 or ~120k faults from run to run (5 runs: 0, 0, 0, 0,
120000), which cannot show what keeping the memory changes."""

import os
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from orlhf.cpu.memory import keep_freed_memory
import ctypes
# both start from glibc's default threshold, held: every 6 MB block is mmapped and returned when freed
assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # as a train step: several logits-sized blocks live at once, then all freed
    live = [torch.ones(64, 25, 965) for _ in range(4)]
    del live
for _ in range(6):  # warm-up: the heap settles (kept, it grew by one step's blocks at the 4th step in 3 of 20 runs)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    # 80 x 6 MB written: returned to the OS when freed, every block comes back as fresh pages (~120k faults);
    # kept, the memory is reused
    plain, keep = _faults("plain"), _faults("keep")
    assert plain > 50_000, plain  # the pattern does reproduce the faults
    assert keep < plain / 20, (keep, plain)


RELEASE_CHILD = """
import ctypes
from orlhf.cpu.memory import keep_freed_memory, release_freed_memory

def rss_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) // 1024

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
assert keep_freed_memory()
start = rss_mib()
blocks = [libc.malloc(8 << 20) for _ in range(32)]  # 256 MiB in heap blocks, written: resident
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
for b in blocks:
    libc.free(ctypes.c_void_p(b))
kept = rss_mib() - start
assert release_freed_memory()
print(kept, rss_mib() - start)
"""


THREAD_CHILD = """
import resource, threading, torch
from orlhf.cpu.memory import keep_freed_memory
assert keep_freed_memory()
out = []
def calls():  # as a rank's compute thread: a call's 96 MiB blocks, freed, then the next call's
    def call():
        live = [torch.ones(96 << 18) for _ in range(3)]
        del live
    for _ in range(6):  # warm-up: torch's 64-byte aligned blocks leave the heap a few fragments before it settles
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        call()
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=calls)
t.start()
t.join()
print(out[0])
"""


def _thread_faults(env: dict) -> int:
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", THREAD_CHILD], capture_output=True, text=True, check=True, env={**clean, **env}
    ).stdout
    return int(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc arenas")
def test_large_blocks_of_a_compute_thread_are_reused_with_the_cluster_env():
    """A thread's own arena maps every block above its 64 MiB heaps afresh (30 x 96 MiB written: ~740k faults); in
    a process started with cluster_env() the main heap serves them again."""
    from orlhf.cpu.memory import cluster_env

    env = cluster_env() or {"MALLOC_ARENA_MAX": "1"}  # empty where the test's own environment sets it
    plain, one_arena = _thread_faults({}), _thread_faults(env)
    assert plain > 300_000, plain  # the pattern does reproduce the faults
    assert one_arena < plain / 20, (one_arena, plain)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_gives_the_kept_memory_back_when_a_call_ends():
    """What keep_freed_memory keeps stays resident after it is freed; release_freed_memory gives it back to the OS."""
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True, text=True, check=True).stdout
    kept, released = map(int, out.strip().splitlines()[-1].split())
    assert kept > 200, kept  # freed, still resident: kept for reuse
    assert released < 50, released
