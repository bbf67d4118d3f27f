"""--bf16 on a CPU without bf16 instructions: refused before Ray starts, with what it costs measured on the spot.

torch computes bf16 at speed on a CPU only with its bf16 instructions (x86: avx512_bf16 or amx_bf16; Arm: bf16);
elsewhere every bf16 matmul is emulated, and a bf16 run takes many times as long as the same run in fp32
(benchmarks/results/2026-12-02-cpu-bf16-slowdown.md, benchmarks/probes/bench_cpu_bf16.py). A user who asks for
--bf16 on such a CPU gets a ConfigError that names the CPU, the missing flags and the slowdown, timed here (a bf16
against an fp32 matmul, a fraction of a second: CPUs differ), and the two ways out: fp32 (no --bf16) or
--allow_slow_bf16.

    cpu_info() -> CpuInfo(model, arch, flags) | None   from /proc/cpuinfo, no torch; None where it cannot be read
    matmul_seconds(rows, dim) -> {dtype: seconds}      the best of a few (rows, dim) @ (dim, dim) products, one thread
    check_bf16(cfg)                                    the refusal (CpuTuning.preflight, from launch/preflight.py)

It reads the driver's CPU: the machine a local cluster's ranks run on (a remote cluster's nodes are not asked).
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("orlhf")

# The flags (x86) or features (Arm) with which torch runs bf16 matmuls natively, by /proc/cpuinfo's architecture.
NATIVE_BF16 = {"x86": ("avx512_bf16", "amx_bf16"), "arm": ("bf16",)}
CHECK_ROWS, CHECK_DIM = 64, 576  # a micro-batch's 64 tokens through a 576-wide projection (SmolLM2-135M's hidden)
RESULTS = "benchmarks/results/2026-12-02-cpu-bf16-slowdown.md"


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as /proc/cpuinfo names it: `model` ("AMD EPYC"), `arch` ("x86" | "arm"), its `flags`."""

    model: str
    arch: str
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in NATIVE_BF16[self.arch])

    def missing(self) -> str:
        """'neither avx512_bf16 nor amx_bf16' (x86) or 'no bf16' (Arm): the flags whose absence makes bf16 slow."""
        names = NATIVE_BF16[self.arch]
        return "no " + names[0] if len(names) == 1 else "neither " + " nor ".join(names)


def cpu_info(path: str = "/proc/cpuinfo") -> Optional[CpuInfo]:
    """The first processor of `path` (Linux's /proc/cpuinfo): its model name and flags ("flags" on x86, "Features"
    on Arm). None where the file is missing or names neither (macOS, an unknown layout): nothing is refused then."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    for key, arch in (("flags", "x86"), ("features", "arm")):
        if key in fields:
            model = fields.get("model name") or platform.processor() or platform.machine()
            return CpuInfo(model, arch, frozenset(fields[key].split()))
    return None


def matmul_seconds(rows: int = CHECK_ROWS, dim: int = CHECK_DIM, repeats: int = 3) -> dict[str, float]:
    """{"fp32": s, "bf16": s}: the fastest of `repeats` (rows, dim) @ (dim, dim) products in each dtype, interleaved,
    after one warm-up each, on one torch thread (a rank's compute thread; the driver's count is restored)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(rows, dim), torch.randn(dim, dim)
        pairs = {"fp32": (x, w), "bf16": (x.bfloat16(), w.bfloat16())}
        best = dict.fromkeys(pairs, float("inf"))
        for i in range(repeats + 1):
            for dtype, (a, b) in pairs.items():
                t0 = time.perf_counter()
                a @ b
                if i:  # the first round warms up
                    best[dtype] = min(best[dtype], time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(threads)


def check_bf16(cfg, cpu: Optional[CpuInfo] = None, timing: Optional[Callable[[], dict]] = None) -> None:
    """--bf16 on --device cpu where the CPU lacks bf16 instructions: a ConfigError (exit 2) naming the CPU, the
    missing flags, the slowdown timed now (`timing`: matmul_seconds), and the ways out; with --allow_slow_bf16 a
    warning instead (not timed). `cpu`: cpu_info() unless given."""
    cpu = cpu or cpu_info()
    if cfg.runtime.device != "cpu" or not cfg.deepspeed.bf16 or cpu is None or cpu.native_bf16:
        return
    if cfg.deepspeed.allow_slow_bf16:
        log.warning(
            "--allow_slow_bf16: this CPU (%s) has %s among its flags, so torch emulates bf16 and the run takes many "
            "times as long as in fp32 (%s)",
            cpu.model,
            cpu.missing(),
            RESULTS,
        )
        return
    from orlhf.config.train_config import ConfigError

    s = (timing or matmul_seconds)()
    raise ConfigError(
        [
            f"--bf16 on --device cpu: this CPU ({cpu.model}) has {cpu.missing()} among its flags, so torch emulates "
            f"bf16, and a bf16 matmul ran {s['bf16'] / s['fp32']:.0f}x slower than fp32 here (measured now: "
            f"{CHECK_ROWS}x{CHECK_DIM} @ {CHECK_DIM}x{CHECK_DIM} in {1e3 * s['bf16']:.1f} ms against "
            f"{1e3 * s['fp32']:.2f} ms). Drop --bf16 to train in fp32, or pass --allow_slow_bf16 to train in bf16 "
            "anyway."
        ]
    )
