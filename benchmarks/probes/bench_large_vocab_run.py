"""The actor rank's peak memory in a whole `orlhf train-ppo` run on a large vocabulary: whole logits against chunks.

    model_presets.large_vocab_model: a random Llama with Qwen's 151,936-token vocabulary and a tiny body (hidden 64,
    2 layers, ~19.5M parameters, nearly all of them embeddings and LM head), the demo's tokenizer grown with filler
    words; the demo's prompts and reward function
    -> per mode, one `orlhf train-ppo --device cpu` run: GRPO (group_norm, 4 samples per prompt, KL loss, so the
       reference scores too, in the actor's process on CPU), --generate_max_len 512, micro-batches of 8,
       --max_samples / --rollout_batch_size steps of one episode
         whole     --logprobs_chunk_mb 0: the [micro-batch, 512, 151936] logits made whole, as before chunking
         chunked   the default --logprobs_chunk_mb, or --chunk_mb
    -> the actor rank's pid from the run's "actor: 1 rank(s), pids [...]" line, its VmHWM (the kernel's own peak
       RSS of that process) read from /proc every 0.2 s until the run ends, and as step 1 begins (what the process
       holds before any logits: libraries, weights, Adam states); proctree.py's sampled peaks per group beside it
    -> a table and one JSON line: peak per mode, and chunked / whole

A random model with this vocabulary almost never samples the end token, so every response runs to 512 tokens.
The whole-logits mode needs several copies of one micro-batch's logits (8 x 512 x 151936 fp32 = 2.3 GiB each):
it is skipped, and the JSON says so, when the machine's MemAvailable is below --whole_min_free_gib. Every process
of the runs gets oom_score_adj 1000 (inherited), so on a shared machine the kernel would end these runs first.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_large_vocab_run.py      # minutes per mode on 2 cores
    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_large_vocab_run.py --modes chunked
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers

from model_presets import QWEN_VOCAB, bench_cache, large_vocab_model, param_count  # noqa: E402
from proctree import run_sampled  # noqa: E402

MODES = {"whole": ["--logprobs_chunk_mb", "0"], "chunked": []}
PIDS_LINE = re.compile(r"actor: \d+ rank\(s\), pids \[([\d, ]+)\]")
GIB = 2**30


def run_flags(model: Path, a: argparse.Namespace) -> list[str]:
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    samples = 4
    return [
        "--device", "cpu",
        "--pretrain", str(model),
        "--prompt_data", str(demo.prompts),
        "--input_key", "prompt",
        "--label_key", "label",
        "--remote_rm_url", str(demo.reward_fn),
        "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", str(samples),
        "--use_kl_loss",
        "--rollout_batch_size", str(a.rollout_batch_size),
        "--train_batch_size", str(a.rollout_batch_size * samples),
        "--micro_train_batch_size", str(a.micro_batch),
        "--micro_rollout_batch_size", str(a.micro_batch),
        "--prompt_max_len", "64",
        "--generate_max_len", str(a.generate_max_len),
        "--max_samples", str(a.steps * a.rollout_batch_size),
        "--num_episodes", "1",
    ]  # fmt: skip


def mem_available() -> float:
    """MemAvailable of this machine, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return 0.0


def vm_hwm(pid: int) -> Optional[float]:
    """The peak RSS of process `pid` so far (VmHWM, bytes); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class ActorPeak(threading.Thread):
    """Waits for the actor's pid line in `log`, then keeps the last VmHWM read of that process until `done`; and
    the VmHWM when the run's start-up line appears (the first step begins: weights, Adam states, libraries)."""

    def __init__(self, log: Path, every: float = 0.2):
        super().__init__(daemon=True)
        self.log, self.every = log, every
        self.pid: Optional[int] = None
        self.peak = 0.0
        self.at_first_step: Optional[float] = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            if self.pid is None:
                m = PIDS_LINE.search(text)
                self.pid = int(m.group(1).split(",")[0]) if m else None
            if self.pid is not None:
                self.peak = max(self.peak, vm_hwm(self.pid) or 0.0)
                if self.at_first_step is None and "to the first step" in text:  # the start-up line
                    self.at_first_step = self.peak
            self.done.wait(self.every)


def run_mode(mode: str, flags: list[str], work: Path, timeout: float, chunk_mb: Optional[float]) -> dict:
    save = work / mode
    save.mkdir(parents=True, exist_ok=True)
    log = save / "run.log"
    own = ["--logprobs_chunk_mb", f"{chunk_mb:g}"] if mode == "chunked" and chunk_mb else MODES[mode]
    cmd = [sys.executable, "-m", "orlhf.cli", "train-ppo", *flags, *own, "--save_path", str(save)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    peak = ActorPeak(log)
    peak.start()
    t = time.monotonic()
    try:
        rc, tree = run_sampled(cmd, os.getcwd(), log, env, timeout)
    finally:
        peak.done.set()
        peak.join()
    metrics = save / "metrics.jsonl"
    steps = sum(1 for line in open(metrics) if line.strip()) if metrics.exists() else 0
    if rc != 0:
        print("\n".join(log.read_text(errors="replace").splitlines()[-15:]), file=sys.stderr)
    return {
        "rc": rc,
        "steps": steps,
        "seconds": round(time.monotonic() - t, 1),
        "actor_pid": peak.pid,
        "actor_vmhwm_gib": peak.peak / GIB if peak.pid else None,
        "actor_vmhwm_at_first_step_gib": peak.at_first_step / GIB if peak.at_first_step else None,
        "rank_actor_rss_sampled_gib": tree.peak.get("RankActor", 0.0) / GIB,
        "engine_rss_sampled_gib": tree.peak.get("EngineActor", 0.0) / GIB,
        "tree_rss_sampled_gib": tree.peak_total / GIB,
        "command": " ".join(cmd),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="whole,chunked", help=f"comma-separated: {', '.join(MODES)}")
    ap.add_argument("--chunk_mb", type=float, default=None, help="chunked mode's --logprobs_chunk_mb (default: its)")
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB)
    ap.add_argument("--steps", type=int, default=3, help="train steps per run (prompts = steps x rollout batch)")
    ap.add_argument("--rollout_batch_size", type=int, default=4, help="prompts per step (x 4 samples)")
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--generate_max_len", type=int, default=512)
    ap.add_argument("--whole_min_free_gib", type=float, default=0.0, help="default: 5 micro-batch logits + 4 GiB")
    ap.add_argument("--timeout_s", type=float, default=1200, help="per run")
    ap.add_argument("--workdir", default=None, help="run folders (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes {a.modes!r}: choose from {', '.join(MODES)}")
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")  # inherited by every process of the runs
    except OSError:
        pass  # not Linux, or no /proc: the runs keep the default
    model = large_vocab_model(bench_cache(), a.vocab, max_len=64 + a.generate_max_len)
    params = param_count(model)
    flags = run_flags(model, a)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_large_vocab_"))
    logits_gib = a.micro_batch * a.generate_max_len * a.vocab * 4 / GIB  # one micro-batch's fp32 logits
    need = a.whole_min_free_gib or 5 * logits_gib + 4
    print(f"model {model} ({params / 1e6:.1f}M params), one micro-batch's logits {logits_gib:.2f} GiB", flush=True)
    results: dict[str, dict] = {}
    for mode in modes:
        free = mem_available() / GIB
        if mode == "whole" and free < need:
            results[mode] = {"skipped": f"MemAvailable {free:.1f} GiB < {need:.1f} GiB needed"}
            print(f"{mode:>8}: skipped ({results[mode]['skipped']})", flush=True)
            continue
        r = results[mode] = {**run_mode(mode, flags, work, a.timeout_s, a.chunk_mb), "mem_available_before_gib": free}
        hwm = "n/a" if r["actor_vmhwm_gib"] is None else f"{r['actor_vmhwm_gib']:.2f} GiB"
        if r["actor_vmhwm_at_first_step_gib"] is not None:
            hwm += f" ({r['actor_vmhwm_at_first_step_gib']:.2f} GiB as step 1 began)"
        print(
            f"{mode:>8}: actor rank peak RSS (VmHWM) {hwm}; sampled: rank actors {r['rank_actor_rss_sampled_gib']:.2f}"
            f", engine {r['engine_rss_sampled_gib']:.2f}, whole tree {r['tree_rss_sampled_gib']:.2f} GiB; "
            f"{r['steps']} steps, {r['seconds']} s, exit {r['rc']}",
            flush=True,
        )
    whole, chunked = (results.get(m, {}).get("actor_vmhwm_gib") for m in ("whole", "chunked"))
    out = {
        "vocab": a.vocab,
        "params": params,
        "micro_batch": a.micro_batch,
        "generate_max_len": a.generate_max_len,
        "logits_gib_per_micro_batch": logits_gib,
        "flags": flags,
        "modes": results,
        "chunked_over_whole": chunked / whole if whole and chunked else None,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    if any(r.get("rc", 0) != 0 for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
