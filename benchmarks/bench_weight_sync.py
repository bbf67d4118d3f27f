"""Weight-sync bandwidth: orlhf's trainer -> vLLM sync against a raw memcpy of the same bytes (CPU, gloo).

    random Llama in a tmp folder (default hidden 768, 12 layers, vocab 32000: 134M params, 537 MB fp32)
      |-- ActorGroup("actor", PolicyWorker, ZeRO-3, --actor_ranks ranks)   the real trainer side
      |-- EngineGroup(--engines vLLM engines, in-process, eager)           the real rollout side
      '-- WeightSync(actor, engines, "gloo", --bucket_mb)
    1. sync_s      WeightSync.sync(), median of --repeats after one warm-up          (the headline)
    2. breakdown   the same calls with timers wrapped around the real code paths (median of --repeats):
                   gather  = actor rank 0 inside named_full_weights (ZeRO-3 GatheredParameters, per layer)
                   bcast   = actor rank 0 inside WeightSender.broadcast (blocks while the engine is busy)
                   reload  = engine inside reload_weights, less its waits for tensors (vLLM's layerwise
                             reload: materialize, copy, oneDNN repack, copy back)
                   recv    = engine waiting for tensors (includes waiting for the actor's gather)
                   exposed = transfer - gather - reload: wire time not hidden behind the reload, plus Ray
                             call overheads
    3. gather_only named_full_weights iterated on every rank, nothing sent
    4. bcast_only  the same tensors broadcast over the same sync group, engines receive and drop them
    5. memcpy_s    dst.copy_(src) of a buffer of the same bytes in the driver (torch default threads), median

    ratio = (bytes / sync_s) / (bytes / memcpy_s) = memcpy_s / sync_s            target: >= 0.25

Reproduce (2-core CPU box, ~1 min; 2x2 ~2 min; Ray is shut down at the end and the run waits until its actor
and engine processes are gone, reporting any left in `leftover_processes`):
    .venv/bin/python benchmarks/bench_weight_sync.py --out /tmp/bench_weight_sync.json
    .venv/bin/python benchmarks/bench_weight_sync.py --actor_ranks 2 --engines 2

Results: benchmarks/results/2026-11-21-weight-sync.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from orlhf.distributed.endpoints import endpoint  # noqa: E402
from orlhf.workers import PolicyWorker  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench_weight_sync] {msg}", file=sys.stderr, flush=True)


# ---- the model ------------------------------------------------------------------------------------------------


def build_model(out: Path, hidden: int, layers: int, vocab: int, intermediate: int, heads: int) -> int:
    """A random-weight Llama plus a loadable tokenizer in `out`. Returns the parameter count.

    The tokenizer is the demo's (~965 tokens): a model vocabulary at least that large is all vLLM and
    transformers need, so no tokenizer has to be trained here.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from orlhf.demo.builder import ensure_demo

    tok = AutoTokenizer.from_pretrained(ensure_demo().model)
    if vocab < len(tok):
        raise SystemExit(f"--vocab {vocab} is smaller than the demo tokenizer ({len(tok)} tokens); use >= {len(tok)}")
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


# ---- timers wrapped around the real code paths -------------------------------------------------------------------


class BenchPolicyWorker(PolicyWorker):
    """PolicyWorker plus timing entry points. The timed paths call the real methods; only timers are added."""

    @endpoint
    def threads(self) -> int:
        return torch.get_num_threads()

    @endpoint
    def gather_only(self) -> float:
        t0 = time.perf_counter()
        for _ in self.named_full_weights(to_cpu=False, copy=False):
            pass
        return time.perf_counter() - t0

    @endpoint
    def timed_send_weights(self, expected: int) -> dict:
        """send_weights() with timers on the gather (the generator) and on each broadcast (rank 0)."""
        times = {"gather_s": 0.0, "bcast_s": 0.0}
        real_nfw = PolicyWorker.named_full_weights.__get__(self)

        def timed_groups(*args, **kwargs):
            it = real_nfw(*args, **kwargs)
            while True:
                t0 = time.perf_counter()
                group = next(it, None)
                times["gather_s"] += time.perf_counter() - t0
                if group is None:
                    return
                yield group

        sender = getattr(self, "_sender", None)
        if sender is not None:
            real_bcast = sender.broadcast

            def timed_bcast(t):
                t0 = time.perf_counter()
                real_bcast(t)
                times["bcast_s"] += time.perf_counter() - t0

            sender.broadcast = timed_bcast
        self.named_full_weights = timed_groups
        t0 = time.perf_counter()
        try:
            times["sent"] = self.send_weights(expected)
        finally:
            del self.named_full_weights
            if sender is not None:
                del sender.broadcast
        times["total_s"] = time.perf_counter() - t0
        return times

    @endpoint
    def bcast_only(self) -> float:
        """Broadcast this rank's gathered weights (copied once, outside the timer) over the sync group."""
        tensors = [t for group in self.named_full_weights(to_cpu=True, copy=True) for _, t in group]
        if self.rank != 0:
            return 0.0
        t0 = time.perf_counter()
        for t in tensors:
            self._sender.broadcast(t)
        return time.perf_counter() - t0


def engine_timed_receive(worker, metas, buckets) -> dict:
    """Runs inside the vLLM worker (collective_rpc callable): orlhf_receive_weights with timers.

    recv_s = waiting for tensors (blocking broadcasts, or pulling the next tensor from the receive stream);
    reload_s = time inside reload_weights minus the time it spent pulling tensors (vLLM's own work)."""
    worker = getattr(worker, "worker", worker)  # vLLM hands callables its WorkerWrapperBase
    times = {"recv_s": 0.0, "reload_s": 0.0}
    real_bcast, real_reload = worker._orlhf_broadcast, worker.reload_weights

    def bcast(t):
        t0 = time.perf_counter()
        real_bcast(t)
        times["recv_s"] += time.perf_counter() - t0

    def timed_iter(weights):
        it = iter(weights)
        while True:
            t0 = time.perf_counter()
            item = next(it, None)
            times["recv_s"] += time.perf_counter() - t0
            times["pull_s"] += time.perf_counter() - t0
            if item is None:
                return
            yield item

    def reload(*args, weights_iterator=None, **kwargs):
        times["pull_s"] = 0.0
        t0 = time.perf_counter()
        real_reload(*args, weights_iterator=timed_iter(weights_iterator), **kwargs)
        times["reload_s"] += time.perf_counter() - t0 - times.pop("pull_s")

    worker._orlhf_broadcast, worker.reload_weights = bcast, reload
    t0 = time.perf_counter()
    try:
        times["loaded"] = worker.orlhf_receive_weights(metas, buckets)
    finally:
        del worker._orlhf_broadcast, worker.reload_weights
    times["total_s"] = time.perf_counter() - t0
    return times


def engine_receive_drop(worker, metas) -> float:
    """Receive every tensor over the sync group and drop it (no reload): the wire-only baseline."""
    from orlhf.rollout.worker_ext import _DTYPES

    worker = getattr(worker, "worker", worker)
    t0 = time.perf_counter()
    for _, dtype, shape in metas:
        worker._orlhf_broadcast(torch.empty(tuple(shape), dtype=_DTYPES[dtype]))
    return time.perf_counter() - t0


def engine_threads(worker) -> int:
    return torch.get_num_threads()


# ---- measurements ---------------------------------------------------------------------------------------------


def memcpy_seconds(nbytes: int, repeats: int, threads: int | None = None) -> float:
    src = torch.rand(nbytes // 4)  # float32, as the weights
    dst = torch.empty_like(src)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dst.copy_(src)  # fault the pages in
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return statistics.median(times)


def instrumented_sync(sync, version: int) -> dict:
    """WeightSync.sync()'s calls in its order, with the timed entry points in place of the plain ones."""
    from orlhf.distributed.groups import wait_calls
    from orlhf.rollout.engine import EngineActor
    from orlhf.rollout.weight_sync import finish

    t0 = time.perf_counter()
    receive = sync.engines.call(EngineActor.collective_rpc, engine_timed_receive, (sync.metas, sync.buckets))
    send = sync.actor.call(BenchPolicyWorker.timed_send_weights, len(sync.metas))
    engine_results, actor_times = wait_calls(receive, send, timeout_s=600)
    engine_times = [r[0] for r in engine_results]
    t_transfer = time.perf_counter() - t0
    finish(sync.engines, version)
    total = time.perf_counter() - t0
    a0 = actor_times[0]
    reload = max(e["reload_s"] for e in engine_times)
    return {
        "total_s": total,
        "transfer_s": t_transfer,
        "reset_s": total - t_transfer,
        "gather_s": a0["gather_s"],
        "bcast_s": a0["bcast_s"],
        "recv_s": max(e["recv_s"] for e in engine_times),
        "reload_s": reload,
        "exposed_s": max(0.0, t_transfer - a0["gather_s"] - reload),
    }


def run(args) -> dict:
    import ray

    from orlhf.config.flags import build_config
    from orlhf.config.worker_config import worker_config
    from orlhf.demo.builder import ensure_demo
    from orlhf.distributed.groups import ActorGroup
    from orlhf.distributed.placement import EngineBundles, RankBundle
    from orlhf.launch.bringup import tuning_for
    from orlhf.rollout.engine import EngineActor
    from orlhf.rollout.engine_config import engine_config
    from orlhf.rollout.engine_group import EngineGroup
    from orlhf.rollout.weight_sync import WeightSync, _nbytes

    tmp = Path(tempfile.mkdtemp(prefix="orlhf-bench-ws-"))
    try:
        t0 = time.perf_counter()
        params = build_model(tmp, args.hidden, args.layers, args.vocab, args.intermediate, args.heads)
        log(f"model: {params / 1e6:.1f}M params in {time.perf_counter() - t0:.1f} s -> {tmp}")
        demo = ensure_demo()
        flags = {
            "pretrain": str(tmp),
            "prompt_data": str(demo.prompts),
            "remote_rm_url": str(demo.reward_fn),
            "actor_num_gpus_per_node": args.actor_ranks,
            "vllm_num_engines": args.engines,
            "vllm_cpu_kv_cache_gb": 0.25,
            "vllm_sync_bucket_mb": args.bucket_mb,
            "enforce_eager": True,
            "advantage_estimator": "reinforce",
            "device": "cpu",
            "prompt_max_len": 128,
            "generate_max_len": 128,
            "train_batch_size": 8 * args.actor_ranks,
            "micro_train_batch_size": 8,
            "rollout_batch_size": 8 * args.actor_ranks,
        }
        cfg = build_config(flags, explicit=set(flags))

        info = ray.init(
            address="local",
            num_cpus=16,
            include_dashboard=False,
            log_to_driver=args.verbose,
            runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}},
        )
        session = Path(info.address_info["session_dir"]).name
        # ray.init installs its own SIGTERM handler, which exits without running the clean-up below: take it back.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        t0 = time.perf_counter()
        slots = [EngineBundles(None, [0], 1.0)] * args.engines
        engines = EngineGroup(engine_config(cfg), slots, timeout_s=600, tuning=tuning_for(cfg))
        actor = ActorGroup(
            "actor",
            BenchPolicyWorker,
            worker_config(cfg, "actor"),
            [RankBundle(None, 0, 1.0)] * args.actor_ranks,
            device="cpu",
            gpus_per_node=args.actor_ranks,
            timeout_s=600,
        )
        actor.call(BenchPolicyWorker.init).get()
        sync = WeightSync(actor, engines, backend="gloo", bucket_mb=args.bucket_mb, timeout_s=600)
        log(
            f"{args.actor_ranks} actor rank(s) + {args.engines} engine(s) + sync group in "
            f"{time.perf_counter() - t0:.1f} s; {len(sync.metas)} tensors in {len(sync.buckets)} bucket(s)"
        )
        nbytes = sum(_nbytes(m) for m in sync.metas)

        sync.sync(version=0)  # warm-up: first-touch allocations, first reload
        sync_times = []
        for i in range(args.repeats):
            sync_times.append(sync.sync(version=i + 1))
            log(f"sync {i + 1}/{args.repeats}: {sync_times[-1]:.3f} s")
        parts = []
        for i in range(args.repeats):
            parts.append(instrumented_sync(sync, version=100 + i))
            log("instrumented: " + " ".join(f"{k}={v:.3f}" for k, v in parts[-1].items()))
        gather_only = [max(actor.call(BenchPolicyWorker.gather_only).get()) for _ in range(args.repeats)]
        bcast_only = []
        for _ in range(args.repeats):
            drop = engines.call(EngineActor.collective_rpc, engine_receive_drop, (sync.metas,))
            bcast_only.append(actor.call(BenchPolicyWorker.bcast_only).get()[0])
            drop.get(600)
        worker_pids = actor.pids() + engines.call(EngineActor.pid).get()
        actor_threads = actor.call(BenchPolicyWorker.threads).get()
        eng_threads = [r[0] for r in engines.call(EngineActor.collective_rpc, engine_threads).get()]

        memcpy = [memcpy_seconds(nbytes, args.repeats) for _ in range(3)]
        memcpy_1t = memcpy_seconds(nbytes, args.repeats, threads=1)
        engines.shutdown()
        actor.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    sync_s, memcpy_s = statistics.median(sync_times), statistics.median(memcpy)
    gb = nbytes / 1e9
    return {
        "bench": "weight_sync",
        "params": params,
        "bytes": nbytes,
        "dtype": "float32",
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": args.vocab,
        "actor_ranks": args.actor_ranks,
        "engines": args.engines,
        "bucket_mb": args.bucket_mb,
        "tensors": len(sync.metas),
        "buckets": len(sync.buckets),
        "repeats": args.repeats,
        "sync_s": sync_s,
        "sync_s_all": sync_times,
        "memcpy_s": memcpy_s,
        "memcpy_1thread_s": memcpy_1t,
        "sync_GBps": gb / sync_s,
        "memcpy_GBps": gb / memcpy_s,
        "memcpy_1thread_GBps": gb / memcpy_1t,
        "ratio": memcpy_s / sync_s,
        "breakdown": {
            **med,
            "gather_only_s": statistics.median(gather_only),
            "bcast_only_s": statistics.median(bcast_only),
        },
        "threads": {"driver_memcpy": torch.get_num_threads(), "actor": actor_threads, "engine": eng_threads},
        "ray_session": session,
        "worker_pids": worker_pids,
    }


def leftover_processes(session: str, pids: list[int], wait_s: float = 60.0) -> list[str]:
    """Processes of this run still alive after up to wait_s: its Ray session's daemons, its actor and engine
    processes, or children of this process (other jobs on the machine may run their own Ray clusters: those are
    not ours to count). ray.kill and ray.shutdown return before the processes are gone; a 2 GB engine under load
    has taken over a minute to exit."""
    me = str(os.getpid())
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
        left = []
        for line in out:
            pid, ppid, cmd = line.split(None, 2)
            if "<defunct>" in cmd:  # exited, not yet reaped by init: holds no memory, runs nothing
                continue
            if pid != me and "ps -eo" not in cmd and (session in cmd or ppid == me or int(pid) in pids):
                left.append(line.strip()[:160])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


def table(r: dict) -> str:
    b = r["breakdown"]
    rows = [
        (
            "model",
            f"{r['params'] / 1e6:.1f}M params, {r['bytes'] / 1e6:.0f} MB fp32, {r['tensors']} tensors, "
            f"{r['buckets']} bucket(s) of <= {r['bucket_mb']:g} MiB",
        ),
        ("layout", f"{r['actor_ranks']} actor rank(s) ZeRO-3 -> {r['engines']} vLLM engine(s), gloo"),
        ("sync (WeightSync.sync)", f"{r['sync_s']:.3f} s  {r['sync_GBps']:.2f} GB/s"),
        (f"memcpy (copy_, {r['threads']['driver_memcpy']} thr)", f"{r['memcpy_s']:.3f} s  {r['memcpy_GBps']:.2f} GB/s"),
        ("memcpy (copy_, 1 thr)", f"{r['memcpy_1thread_s']:.3f} s  {r['memcpy_1thread_GBps']:.2f} GB/s"),
        ("ratio sync/memcpy", f"{r['ratio']:.3f}  (target >= 0.25: {'met' if r['ratio'] >= 0.25 else 'NOT met'})"),
        ("-- instrumented sync", f"{b['total_s']:.3f} s"),
        ("   gather (actor r0)", f"{b['gather_s']:.3f} s"),
        ("   broadcast (actor r0)", f"{b['bcast_s']:.3f} s (incl. waits for the engine's reload)"),
        ("   recv (engine)", f"{b['recv_s']:.3f} s (incl. waits for the actor's gather)"),
        ("   reload_weights (engine)", f"{b['reload_s']:.3f} s"),
        ("   exposed wire + overheads", f"{b['exposed_s']:.3f} s"),
        ("   reset + version (driver)", f"{b['reset_s']:.3f} s"),
        ("gather only (all ranks)", f"{b['gather_only_s']:.3f} s"),
        ("broadcast only (no reload)", f"{b['bcast_only_s']:.3f} s  {r['bytes'] / 1e9 / b['bcast_only_s']:.2f} GB/s"),
        ("threads", f"actor {r['threads']['actor']}, engine {r['threads']['engine']}"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{w}} | {v} |" for k, v in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--actor_ranks", type=int, default=1)
    p.add_argument("--bucket_mb", type=float, default=256.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=str, default=None, help="also write the result JSON here")
    p.add_argument("--verbose", action="store_true", help="show the Ray workers' logs")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` / kill: still run run()'s clean-up
    result = run(args)
    left = leftover_processes(result["ray_session"], result.pop("worker_pids"))
    result["leftover_processes"] = len(left)
    if left:
        log("WARNING: processes left behind:\n  " + "\n  ".join(left))
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
