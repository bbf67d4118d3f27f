"""CPU rank and engine processes keep freed memory in glibc's heap for the next allocation, within a call and
across calls.

    cluster_env()          environment for the processes of a local CPU cluster orlhf starts (CpuTuning.cluster_env):
                           MALLOC_ARENA_MAX=1, every thread allocates from glibc's main heap
    keep_freed_memory()    at a rank process's start (CpuRankActor) and a CPU engine's (CpuTuning.engine_start):
                           blocks up to 2 GiB come from the heap
    release_freed_memory() gives the heap's free memory back to the OS (glibc's malloc_trim), for callers that
                           want the RSS down between phases (benchmarks); rank processes do not call it

Why: a CPU train step allocates and frees blocks of tens to hundreds of MiB many times (a micro-batch's logits,
the LM head's gradient, ZeRO's flat fp32 partitions). Each block glibc maps afresh with mmap comes back as zeroed
pages, one page fault per 4 KiB, and its munmap is a TLB shootdown: on a real model's step the kernel's share of
the rank's time became large (benchmarks/results/ has the measurements).

Why in the engine too: every weight sync allocates afresh what it received (the sync's buckets, hundreds of MiB
for a real model) and what vLLM-CPU's reload rebuilds (each linear layer's pre-packed weight, the tied LM head's
among them), and frees the previous ones; above glibc's own mmap threshold (at most 32 MiB) each of those blocks
came as fresh pages, so every sync paid a page fault per 4 KiB of them on top of the copies. As in a rank, the
engine's RSS then stays near the highest a sync took it, instead of dropping back between syncs.

Why one arena: a rank runs every call on a compute thread of its own (cpu/rank_actor.py), and glibc gives each
such thread an arena of its own whose heaps are at most 64 MiB; a larger block there is always mmapped, whatever
M_MMAP_THRESHOLD says. Only the main arena (grown with brk) serves large blocks from freed memory. The arena count
is fixed when a process's allocator starts (MALLOC_ARENA_MAX, read from the environment): mallopt(M_ARENA_MAX)
later, once Ray's threads have arenas, still hands a new thread one of those. So it is set in the environment of
the cluster's processes before they start. A cluster orlhf joins keeps its own workers' environment (there, start
its Ray with MALLOC_ARENA_MAX=1 for the same effect). The rank's threads other than the compute thread allocate
little (Ray's, the health check's), so one arena costs no lock contention that shows.

Why no trim after each call: with one arena a call reuses what the previous one freed (a reference forward's
blocks serve the train step's), so the peak is the largest call's, not a sum; returning the memory after every
call only made the next call fault it all in again. The RSS stays near the peak between calls, and a heap top
more than M_TRIM_THRESHOLD (1 GiB) free still goes back to the OS by itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Optional

# glibc malloc: blocks >= M_MMAP_THRESHOLD get their own mmap (mallopt takes an int: 2 GiB - 1 is its largest
# value); a free heap top above M_TRIM_THRESHOLD goes back to the OS.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = (1 << 31) - 1, 1 << 30
ARENA_ENV = "MALLOC_ARENA_MAX"


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def cluster_env() -> dict[str, str]:
    """Environment for the processes of a local CPU cluster: one malloc arena (module docstring); a value the user
    set is theirs and stays."""
    return {} if ARENA_ENV in os.environ else {ARENA_ENV: "1"}


def keep_freed_memory() -> bool:
    """Tell glibc malloc to serve large blocks from the heap and keep freed memory for reuse (CPU ranks); False
    where the C library is not glibc (nothing changes there)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


def release_freed_memory() -> bool:
    """Return the free memory of every malloc arena to the OS (glibc's malloc_trim). False where the C library is
    not glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
