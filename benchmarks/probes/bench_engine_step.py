"""CPU seconds of one demo step's generation through orlhf's own engine class, without Ray.

    finish_config(demo grpo flags) -> engine_config -> EngineActor (in this process, in-process vLLM, as the Ray
    actor runs it) -> --repeats x EngineActor.generate(the step's 64 prompts, SamplingSpec(n=4, <=24 tokens,
    the controller's per-step seed)) -> per call: CPU seconds (process_time) and wall seconds; a digest of the
    rollouts (token ids, log-prob bits, finish flags) that must not change when the engine gets faster.

Threads: --threads (default 1: what an engine gets beside training in async mode, Ray's one per CPU slot; a sync run's
engine gets the cores, orlhf/cpu/threads.py engine_threads; 0: as the demo run's engine_config says). Prompts: the
demo's first --num_prompts rows, tokenized by orlhf's own data path. The same seeds every call (batch index 0), so every
call does the same work and gives the same digest.

--real DIR (a `orlhf make-demo --real` folder): trl_compare's real-model step instead (SmolLM2-135M-Instruct, 16 of its
addition prompts in the chat template x 4 samples, 24 tokens, eager engine). --bf16: the engine in bf16.
--no_share: prefix caching off, so every sample computes its prompt (cpu/engine_kv.py; the default shares each
prompt's full blocks among its samples). The prefix cache is reset before every timed call, as a weight sync does.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_engine_step.py --real DEMO --threads 2 [--no_share]

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/bench_engine_step.py --repeats 10
    py-spy record -r 200 -f raw -o /tmp/gen.txt -- .venv/bin/python benchmarks/probes/bench_engine_step.py --repeats 30
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import struct
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def demo_setup(num_prompts: int, real: str | None = None, bf16: bool = False):
    """(EngineConfig, prompt id lists, SamplingSpec, the run's Tuning) of the demo grpo run's first step (with
    `real`: trl_compare's real-model step)."""
    from orlhf.config.resolve import finish_config
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.launch.bringup import tuning_for
    from orlhf.launch.run_inputs import load_prompts
    from orlhf.rollout.engine_config import engine_config
    from orlhf.types import SamplingSpec

    flags = {"advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "use_kl_loss": True, "max_samples": 128}
    if real:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench_train_step import real_flags

        flags.update(real_flags(real), generate_max_len=24, enforce_eager=True, bf16=bf16)
    cfg = finish_config(flags, frozenset(flags))
    prompts = load_prompts(cfg, load_tokenizer(cfg.data.pretrain))[:num_prompts]
    p = cfg.ppo
    sampling = SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p,
        max_new_tokens=p.generate_max_len,
        max_len=p.max_len,
        n=p.n_samples_per_prompt,
        seed=p.seed * 1_000_003,
    )
    return engine_config(cfg), [q.ids for q in prompts], sampling, tuning_for(cfg)


def digest(rollouts) -> str:
    h = hashlib.sha256()
    for r in rollouts:
        h.update(struct.pack(f"<{len(r.response_ids)}i", *r.response_ids))
        h.update(struct.pack(f"<{len(r.logprobs)}d", *r.logprobs))
        h.update(bytes([r.finished, r.prompt_index & 0xFF]))
    return h.hexdigest()[:16]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--num_prompts", type=int, default=None, help="default: 64 (demo), 16 (--real)")
    ap.add_argument("--real", default=None, help="a make-demo --real folder: the real model's step")
    ap.add_argument("--bf16", action="store_true", help="the engine in bf16")
    ap.add_argument("--no_share", action="store_true", help="every sample computes its prompt (no prefix caching)")
    ap.add_argument("--out", default=None, help="also write the result JSON here")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the engine (0: the demo sync run's, threads.engine_threads)",
    )
    args = ap.parse_args(argv)

    from orlhf.rollout.engine import EngineActor

    num_prompts = args.num_prompts or (16 if args.real else 64)
    ecfg, ids, sampling, tuning = demo_setup(num_prompts, args.real, args.bf16)
    ecfg = dataclasses.replace(ecfg, share_prompts=ecfg.share_prompts and not args.no_share)
    if args.threads:
        ecfg = dataclasses.replace(ecfg, cpu_threads=args.threads)
    t0 = time.process_time()
    engine = EngineActor(ecfg, 0, tuning=tuning)  # as the run's engine starts (on CPU: cpu/tuning.py)
    startup_cpu = time.process_time() - t0
    indexed = list(enumerate(ids))
    c0 = time.process_time()
    engine.generate(indexed, sampling)  # warm-up (the first call also compiles vLLM's log-prob rank kernel)
    warmup_cpu = time.process_time() - c0
    cpu, wall, digests = [], [], set()
    for _ in range(args.repeats):
        engine.reset_prefix_cache()  # as after a weight sync: nothing cached from the previous call
        c0, w0 = time.process_time(), time.perf_counter()
        out = engine.generate(indexed, sampling)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        digests.add(digest(out))
    result = {
        "bench": "engine_step",
        "prompts": len(ids),
        "n": sampling.n,
        "rollouts": len(out),
        "tokens": sum(len(r.response_ids) for r in out),
        "threads": engine.num_threads(),
        "dtype": ecfg.dtype,
        "share_prompts": ecfg.share_prompts,
        "startup_cpu_s": startup_cpu,
        "warmup_cpu_s": warmup_cpu,
        "cpu_s": cpu,
        "wall_s": wall,
        "cpu_median_s": statistics.median(cpu),
        "cpu_min_s": min(cpu),
        "wall_median_s": statistics.median(wall),
        "digests": sorted(digests),
        "load_avg": os.getloadavg(),
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
