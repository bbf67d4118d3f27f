"""Where a CPU actor rank's memory goes, phase by phase: the large-vocabulary run's rank process in one process,
no Ray (what bench_large_vocab_run.py measures whole).

    one process (world size 1, gloo), tuned as a CPU rank process (cpu/rank_actor.tune_rank_process): the actor
    (PolicyWorker, ZeRO-2) and the hosted reference (ReferenceWorker) built from bench_large_vocab_run's flags on
    model_presets.large_vocab_model -> a GRPO-shaped batch (4 demo prompts x 4 samples, left-padded; 512 random
    response tokens each: a random model on this vocabulary never samples the end token)
    -> --steps times, on one compute thread (as CpuRankActor runs every call), in a process with a local CPU
       cluster's environment (one malloc arena: cpu/memory.py):
       the reference's log_probs, the actor's log_probs (a PPO run's old log-probs; this GRPO run's single pass
       does without them, so train_step gets none), train_step, the weight sync's walk over the full weights
       (PolicyWorker.sync_groups, as send_weights walks them; no engine at the other end)
    -> per phase: VmRSS before and after, and the peak during it (VmHWM, reset before each phase through
       /proc/self/clear_refs); inside train_step the same for each micro-batch's loss (forward), backward and
       DeepSpeed's step
    -> a table (the largest peak of each phase over the steps, MiB) and one JSON line

--no_keep_freed_memory leaves glibc's defaults (freed large blocks go back to the OS, one arena per thread),
--release gives what each call freed back to the OS after it returns (malloc_trim): to compare.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_rank_memory.py                 # minutes on 2 cores
    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_rank_memory.py --no_keep_freed_memory
    # the real-model recipe's actor rank (no reference: its KL coefficient is 0), prompts padded to 128 tokens
    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_rank_memory.py --model DIR/model --no_ref \
        --response_len 24 --prompt_len 128
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers

from model_presets import QWEN_VOCAB, bench_cache, large_vocab_model  # noqa: E402

MIB = 2**20


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Probe:
    """Per-phase RSS: before, after and the peak during (VmHWM after a reset), the largest over repeats."""

    def __init__(self):
        self.rows: dict[str, dict[str, float]] = {}
        self.stack: list[float] = []  # the peak of the inner phases so far, per open phase
        self.resettable = True

    def reset_peak(self) -> None:
        if self.resettable:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            except OSError:
                self.resettable = False

    @contextmanager
    def phase(self, name: str):
        """Nested phases: an inner phase resets VmHWM, so its peak is carried up to the enclosing ones."""
        before = status_bytes("VmRSS")
        self.reset_peak()
        self.stack.append(0.0)
        try:
            yield
        finally:
            inner = self.stack.pop()
            after, peak = status_bytes("VmRSS"), max(status_bytes("VmHWM"), inner)
            if self.stack:
                self.stack[-1] = max(self.stack[-1], peak)
            row = self.rows.setdefault(name, {"calls": 0, "before": 0, "after": 0, "peak": 0})
            row["calls"] += 1
            for k, v in (("before", before), ("after", after), ("peak", peak)):
                row[k] = max(row[k], v / MIB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(model: Path, a: argparse.Namespace):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
    )
    from orlhf.config.resolve import finish_config
    from orlhf.config.worker_config import worker_config
    from orlhf.cpu.ds_import import load_deepspeed
    from orlhf.cpu.memory import keep_freed_memory
    from orlhf.demo.builder import ensure_demo
    from orlhf.workers import PolicyWorker, ReferenceWorker

    demo = ensure_demo()
    flags = {
        "device": "cpu",
        "pretrain": str(model),
        "prompt_data": str(demo.prompts),
        "input_key": "prompt",
        "label_key": "label",
        "remote_rm_url": str(demo.reward_fn),
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": 4,
        "use_kl_loss": not a.no_ref,
        "rollout_batch_size": 4,
        "train_batch_size": 16,
        "micro_train_batch_size": a.micro_batch,
        "micro_rollout_batch_size": a.micro_batch,
        "prompt_max_len": max(64, a.prompt_len),
        "generate_max_len": a.response_len,
        "seed": 42,
    }
    if a.chunk_mb is not None:
        flags["logprobs_chunk_mb"] = a.chunk_mb
    cfg = finish_config(flags, frozenset(flags))
    if not a.no_keep_freed_memory:
        keep_freed_memory()
    load_deepspeed()
    actor = PolicyWorker(worker_config(cfg, "actor", a.steps + 1))
    ref = None if a.no_ref else ReferenceWorker(worker_config(cfg, "ref", a.steps + 1))
    return cfg, actor, ref


def grpo_batch(cfg, response_len: int, seed: int = 1, prompt_len: int = 0):
    from transformers import AutoTokenizer

    from orlhf.config.worker_config import model_path
    from orlhf.types import SequenceBatch

    tok = AutoTokenizer.from_pretrained(model_path(cfg, "actor"))
    with open(cfg.data.prompt_data) as f:
        prompts = [json.loads(line)["prompt"] for line, _ in zip(f, range(4))]
    ids = [tok(p)["input_ids"][-64:] for p in prompts for _ in range(4)]
    g = torch.Generator().manual_seed(seed)
    if prompt_len:  # every prompt that long: the longest prompt a run's flags allow (--prompt_max_len)
        ids = [torch.randint(4, len(tok), (prompt_len,), generator=g).tolist() for _ in ids]
    P, A, B = max(map(len, ids)), response_len, len(ids)
    seq = torch.full((B, P + A), tok.pad_token_id or 0, dtype=torch.long)
    attn = torch.zeros(B, P + A, dtype=torch.long)
    for i, row in enumerate(ids):
        seq[i, P - len(row) : P] = torch.tensor(row)
        seq[i, P:] = torch.randint(4, len(tok), (A,), generator=g)
        attn[i, P - len(row) :] = 1
    return SequenceBatch(seq, attn, attn[:, P:].bool()), g


def experience(batch, old_lp, ref_lp, g):
    from orlhf.types import Experience

    B, A = batch.action_mask.shape
    adv = torch.randn(B // 4, 4, generator=g)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).reshape(B, 1).expand(B, A)
    return Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=old_lp,
        advantages=(adv * batch.action_mask).contiguous(),
        base_action_log_probs=ref_lp,
    )


def instrument_train(actor, probe: Probe) -> None:
    """Probe each micro-batch's loss (forward), backward and optimizer step inside train_step."""
    engine = actor.engine
    loss_fn = actor._loss
    backward, step = engine.backward, engine.step

    def probed(name, fn):
        def run(*args, **kwargs):
            with probe.phase(name):
                return fn(*args, **kwargs)

        return run

    actor._loss = probed("  train: forward + loss", loss_fn)
    engine.backward = probed("  train: backward", backward)
    engine.step = probed("  train: optimizer step", step)


def walk_sync(actor) -> int:
    n = 0
    for group in actor.sync_groups(to_cpu=False, copy=False):
        for _, t in group:
            t.contiguous()
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--response_len", type=int, default=512)
    ap.add_argument("--chunk_mb", type=float, default=None, help="--logprobs_chunk_mb (default: orlhf's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model folder instead of the large-vocabulary preset")
    ap.add_argument("--prompt_len", type=int, default=0, help="random prompts of this many tokens (0: the demo's)")
    ap.add_argument("--no_ref", action="store_true", help="no reference worker (a run without KL)")
    ap.add_argument("--no_keep_freed_memory", action="store_true", help="glibc's defaults (cpu/memory.py off)")
    ap.add_argument("--release", action="store_true", help="release_freed_memory after each call")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from bench_train_step import as_rank_process

    from orlhf.cpu.memory import release_freed_memory

    if not a.no_keep_freed_memory:
        as_rank_process()

    torch.set_num_threads(a.threads)
    probe = Probe()
    start = status_bytes("VmRSS") / MIB
    model = Path(a.model) if a.model else large_vocab_model(bench_cache(), QWEN_VOCAB, max_len=64 + a.response_len)
    compute = ThreadPoolExecutor(1)  # every call on one thread that is not the main one, as CpuRankActor runs them

    def on_thread(fn, *args):
        def run():
            torch.set_num_threads(a.threads)
            try:
                return fn(*args)
            finally:
                if a.release:
                    release_freed_memory()

        return compute.submit(run).result()

    with probe.phase("imports + build workers"):
        cfg, actor, ref = build(model, a)
    with probe.phase("actor init"):
        on_thread(actor.init)
    if ref is not None:
        with probe.phase("ref init"):
            on_thread(ref.init)
    at_start = status_bytes("VmRSS") / MIB
    batch, g = grpo_batch(cfg, a.response_len, prompt_len=a.prompt_len)
    instrument_train(actor, probe)
    whole_peak = 0.0
    for _ in range(a.steps):
        ref_lp = None
        if ref is not None:
            with probe.phase("ref log_probs"):
                ref_lp = on_thread(ref.log_probs, batch)
        with probe.phase("actor log_probs"):
            on_thread(actor.log_probs, batch)
        exp = experience(batch, None, ref_lp, g)  # one optimizer step per batch: the single pass
        with probe.phase("train_step"):
            t0 = time.perf_counter()
            on_thread(actor.train_step, exp)
            print(f"train_step {time.perf_counter() - t0:.1f} s", flush=True)
        with probe.phase("weight sync walk"):
            on_thread(walk_sync, actor)
        whole_peak = max(whole_peak, max(r["peak"] for r in probe.rows.values()))
    print(f"python start {start:.0f} MiB, after init {at_start:.0f} MiB; peak RSS of the steps {whole_peak:.0f} MiB")
    print(f"{'phase':<28}{'calls':>6}{'before':>9}{'peak':>9}{'after':>9}  MiB (largest over calls)")
    for name, r in probe.rows.items():
        print(f"{name:<28}{r['calls']:>6}{r['before']:>9.0f}{r['peak']:>9.0f}{r['after']:>9.0f}")
    out = {
        "keep_freed_memory": not a.no_keep_freed_memory,
        "release_after_calls": a.release,
        "chunk_mb": actor.cfg.logprobs_chunk_mb,
        "start_mib": start,
        "after_init_mib": at_start,
        "peak_mib": whole_peak,
        "phases": probe.rows,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
