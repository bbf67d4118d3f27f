"""CPU rank processes keep freed memory in the heap while a call runs, and give it back when it returns
(CpuRankActor calls keep_freed_memory at its start and release_freed_memory after each call)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional

# glibc malloc: blocks >= M_MMAP_THRESHOLD get their own mmap, and a free heap top above M_TRIM_THRESHOLD goes back
# to the OS. A CPU train step allocates and frees large activation tensors many times; with the defaults each
# comes back as fresh pages, page faults and system time every step (benchmarks/bench_train_step.py measures it).
# Keeping them in the heap avoids most of them. Memory stays at the call's peak until release_freed_memory.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 256 << 20, 1 << 30


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tell glibc malloc to reuse freed memory instead of returning it to the OS (CPU ranks); False where the C
    library is not glibc (nothing changes there)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


def release_freed_memory() -> bool:
    """Return the free memory of every malloc arena to the OS (glibc's malloc_trim), as a rank's call ends.

    What keep_freed_memory keeps serves the many allocations inside one call; between calls it would only stay in
    the process's RSS, and the next call's large blocks (a chunk of logits is mmapped: above a thread arena's heap
    size) could not reuse it, so each phase's leftovers would add to the next one's peak. One trim per call costs
    the next call one page fault per page it touches again. False where the C library is not glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True
