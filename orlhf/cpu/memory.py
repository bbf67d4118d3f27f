"""CPU rank processes keep freed memory in the heap (CpuRankActor calls keep_freed_memory at its start)."""

from __future__ import annotations

# glibc malloc: blocks >= M_MMAP_THRESHOLD get their own mmap, and a free heap top above M_TRIM_THRESHOLD goes back
# to the OS. A CPU train step allocates and frees large activation tensors many times; with the defaults each
# comes back as fresh pages, page faults and system time every step (benchmarks/bench_train_step.py measures it).
# Keeping them in the heap avoids most of them. Memory stays at the step's peak.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 256 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Tell glibc malloc to reuse freed memory instead of returning it to the OS (CPU ranks); False where the C
    library is not glibc (nothing changes there)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )
