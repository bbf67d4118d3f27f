"""TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder reads it (its ops JIT-compile on first use on GPUs).

torch accepts arch-specific suffixes ("9.0a" for sm_90a, "10.0f"); DeepSpeed 0.19.8's builder sorts the entries by
int() of each dotted part and raises "invalid literal for int() with base 10: '0a'" (found on an H100 whose image
sets TORCH_CUDA_ARCH_LIST=9.0a: FusedAdam under --deepspeed_enable_sleep and the hybrid engine's inference ops
failed to load). DeepSpeed's ops use no arch-specific instructions, so the plain arch ("9.0") builds code that runs
on the same GPUs. A worker on CUDA rewrites the variable for its own process before DeepSpeed builds anything,
and says so once.
"""

from __future__ import annotations

import logging
import os
import re

_ARCH = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")


def deepspeed_arch_list(value: str) -> str | None:
    """`value` written so DeepSpeed can read it, or None when it already can. Entries DeepSpeed cannot read at
    all (not an arch) are left for DeepSpeed to report."""
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    out: list[str] = []
    changed = False
    for e in entries:
        m = _ARCH.fullmatch(e)
        plain = f"{m[1]}.{m[2]}{m[3] or ''}" if m else e
        changed |= plain != e
        if plain not in out:
            out.append(plain)
    return ";".join(out) if changed else None


def use_arch_list_deepspeed_reads() -> None:
    """Rewrite this process's TORCH_CUDA_ARCH_LIST when DeepSpeed could not read it (idempotent)."""
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = deepspeed_arch_list(old) if old else None
    if fixed is None:
        return
    logging.getLogger("orlhf").warning(
        "TORCH_CUDA_ARCH_LIST=%s: DeepSpeed's op builder cannot read arch suffixes; its ops (FusedAdam, inference "
        "kernels) are compiled for %s, which runs on the same GPUs",
        old,
        fixed,
    )
    os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
