"""The trainer side of one demo step, standalone: the actor's train_step and the hosted reference's log_probs, in
CPU seconds, one rank, no Ray (what the RankActor runs beside the engine in --async_train).

    one process (world size 1, gloo): PolicyWorker + ReferenceWorker built from the config trl_compare's orlhf side
    runs (worker_config of finish_config: ZeRO-2 actor, ZeRO-0 ref, fp32, micro-batch 64, k3 KL loss 0.01,
    GRPO single pass) -> a demo-shaped batch (256 rows: 64 demo prompts x 4, left-padded; responses of 24
    random tokens, one in ten shorter, right-padded: demo runs' responses mostly run to the limit)
    -> --warmup untimed steps, then --repeats timed ref log_probs and train_step calls -> CPU seconds
    (time.process_time) and wall seconds per call, min and median, and the first timed step's stats

--threads sets torch's threads (1: as each side of --async_train). --out writes the JSON; --stats-only prints the
train stats of the seeded steps (compare two checkouts: identical stats = identical update). --no_shared_prompt:
every row runs its whole prompt (the batch's 4 samples per prompt otherwise share one prefix pass).
Under py-spy: /tmp/pyspy/bin/py-spy record -r 200 --native -o prof.txt -f raw -- python benchmarks/bench_train_step.py

--real DIR (a `orlhf make-demo --real` folder): trl_compare's real-model step instead: SmolLM2-135M-Instruct, 16 of
its addition prompts in the chat template x 4 samples, micro-batch 16, half the responses at the 24-token limit and
the rest 8-23 tokens. --flags k=v sets any other train-ppo value (e.g. zero_stage=0, bf16=true). Compare checkouts
by running this file with the other checkout's package first on PYTHONPATH.

Reproduce (~1 min): PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_train_step.py --repeats 10
Real model (~4 min, one thread): ... bench_train_step.py --real DEMO --threads 1 --warmup 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

FLAGS = {
    "device": "cpu",
    "advantage_estimator": "group_norm",
    "n_samples_per_prompt": 4,
    "rollout_batch_size": 64,
    "train_batch_size": 256,
    "micro_train_batch_size": 64,
    "micro_rollout_batch_size": 64,
    "generate_max_len": 24,
    "temperature": 1.0,
    "actor_learning_rate": 5e-4,
    "lr_warmup_ratio": 0.0,
    "eps_clip": 0.2,
    "seed": 42,
    "use_kl_loss": True,
    "init_kl_coef": 0.01,
    "kl_estimator": "k3",
}


def build_workers(steps: int, extra: dict | None = None):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29651"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
    )
    from orlhf.config.resolve import finish_config
    from orlhf.config.worker_config import worker_config
    from orlhf.cpu.rank_actor import tune_rank_process
    from orlhf.workers import PolicyWorker, ReferenceWorker

    flags = {**FLAGS, **(extra or {})}
    cfg = finish_config(flags, frozenset(flags))
    actor, ref = PolicyWorker(worker_config(cfg, "actor", steps)), ReferenceWorker(worker_config(cfg, "ref", steps))
    tune_rank_process()  # as orlhf's CPU rank processes do
    actor.init()
    ref.init()  # the hosted reference: same process, the process group already up
    return cfg, actor, ref


def demo_batch(cfg, seed: int = 1):
    """(SequenceBatch, per-row advantages) shaped like a demo step: 64 demo prompts x 4 samples."""
    from transformers import AutoTokenizer

    from orlhf.config.worker_config import model_path

    tok = AutoTokenizer.from_pretrained(model_path(cfg, "actor"))
    with open(cfg.data.prompt_data) as f:
        prompts = [json.loads(line)["prompt"] for line, _ in zip(f, range(64))]
    ids = [tok(p)["input_ids"] for p in prompts for _ in range(4)]
    # demo runs' mean response length is 23.5-23.9 of 24: most responses run to the cap
    return rows_batch(tok, ids, seed, at_cap=0.9, shortest=1)


def rows_batch(tok, ids: list, seed: int, at_cap: float, shortest: int):
    """(SequenceBatch, generator): `ids` left-padded, each followed by random response tokens, `at_cap` of the
    rows at the 24-token cap and the rest shortest..23 tokens."""
    from orlhf.types import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    P, A, B = max(map(len, ids)), 24, len(ids)
    seq = torch.full((B, P + A), tok.pad_token_id or 0, dtype=torch.long)
    attn = torch.zeros(B, P + A, dtype=torch.long)
    for i, row in enumerate(ids):
        n = A if float(torch.rand(1, generator=g)) < at_cap else int(torch.randint(shortest, A, (1,), generator=g))
        seq[i, P - len(row) : P] = torch.tensor(row)
        seq[i, P : P + n] = torch.randint(4, len(tok), (n,), generator=g)
        attn[i, P - len(row) : P + n] = 1
    return SequenceBatch(seq, attn, attn[:, P:].bool()), g


REAL_FLAGS = {  # trl_compare.py's orlhf side on --model_preset smollm2
    "n_samples_per_prompt": 4,
    "rollout_batch_size": 16,
    "train_batch_size": 64,
    "micro_train_batch_size": 16,
    "micro_rollout_batch_size": 16,
    "actor_learning_rate": 1e-6,
    "prompt_max_len": 128,
    "apply_chat_template": True,
    "input_key": "question",
    "label_key": "answer",
}


def real_flags(demo: str) -> dict:
    from orlhf.demo.arith import RealDemoPaths

    paths = RealDemoPaths.under(Path(demo).resolve())
    return {
        **REAL_FLAGS,
        "pretrain": str(paths.model),
        "prompt_data": str(paths.train),
        "remote_rm_url": str(paths.reward_fn),
    }


def real_batch(cfg, seed: int = 1):
    """(SequenceBatch, generator) of the real model's step: 16 templated prompts x 4, responses of random tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.data.pretrain)
    with open(cfg.data.prompt_data) as f:
        questions = [json.loads(line)["question"] for line, _ in zip(f, range(16))]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    ids = [list(c if isinstance(c, list) else c["input_ids"]) for c in chats for _ in range(4)]
    return rows_batch(tok, ids, seed, at_cap=0.5, shortest=8)


def experience(batch, ref_lp, g):
    from orlhf.types import Experience

    B, A = batch.action_mask.shape
    adv = torch.randn(B // 4, 4, generator=g)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).reshape(B, 1).expand(B, A)
    return Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=None,
        advantages=adv * batch.action_mask,
        base_action_log_probs=ref_lp,
        rollout_log_probs=ref_lp + 0.01 * torch.randn(B, A, generator=g),
    )


def timed(fn, repeats: int):
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {
        "cpu_min": min(cpu),
        "cpu_median": statistics.median(cpu),
        "wall_min": min(wall),
        "wall_median": statistics.median(wall),
        "cpu_s": [round(x, 4) for x in cpu],
    }, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stats-only", action="store_true", help="print the seeded steps' train stats and stop")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--as_rank_actor",
        action="store_true",
        help="each call as a CPU rank actor runs it: on one compute thread of its own, the thread count applied "
        "there, in a process started with a local CPU cluster's environment (one malloc arena: cpu/memory.py)",
    )
    ap.add_argument("--real", default=None, help="a make-demo --real folder: the real model's step")
    ap.add_argument("--flags", nargs="*", default=[], help="more train-ppo values, k=v (true/false/numbers)")
    ap.add_argument(
        "--no_shared_prompt",
        action="store_true",
        help="run every row's prompt (train-ppo's flag; default: each distinct prompt once)",
    )
    a = ap.parse_args()
    if a.as_rank_actor:
        as_rank_process()
    torch.set_num_threads(a.threads)
    extra = {**(real_flags(a.real) if a.real else {}), **dict(parse_value(kv) for kv in a.flags)}
    if a.no_shared_prompt:
        extra["no_shared_prompt"] = True
    cfg, actor, ref = build_workers(a.warmup + a.repeats + 1, extra)
    batch, g = real_batch(cfg) if a.real else demo_batch(cfg)
    ref_lp = ref.log_probs(batch)
    exp = experience(batch, ref_lp, g)
    if a.stats_only:
        for _ in range(3):
            s = actor.train_step(exp)
            print(json.dumps({"ref_sum": float(ref_lp.sum()), **{k: v for k, v in vars(s).items()}}, default=str))
        return
    for _ in range(a.warmup):
        ref.log_probs(batch)
        actor.train_step(exp)
    load0 = os.getloadavg()
    call = as_rank_actor(a.threads) if a.as_rank_actor else (lambda fn: fn())
    ref_t, _ = timed(lambda: call(lambda: ref.log_probs(batch)), a.repeats)
    train_t, stats = timed(lambda: call(lambda: actor.train_step(exp)), a.repeats)
    res = {
        "threads": a.threads,
        "shared_prompt": actor.shared_prompt_train,
        "shape": list(batch.sequences.shape),
        "ref_log_probs": ref_t,
        "train_step": train_t,
        "load_avg_before": load0,
        "load_avg_after": os.getloadavg(),
        "last_stats": vars(stats),
    }
    print(
        f"ref log_probs: cpu {ref_t['cpu_median']:.3f} s median ({ref_t['cpu_min']:.3f} min); "
        f"train_step: cpu {train_t['cpu_median']:.3f} s median ({train_t['cpu_min']:.3f} min); "
        f"load {load0[0]:.1f}; each distinct prompt once: {actor.shared_prompt_train}",
        flush=True,
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


def as_rank_process() -> None:
    """This process again, with the environment a local CPU cluster's processes start with (it is read as the C
    library starts, so only a new process takes it)."""
    import sys

    from orlhf.cpu.memory import cluster_env

    env = cluster_env()
    if env:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def as_rank_actor(threads: int):
    """A caller that runs fn() the way CpuRankActor.call_as does."""
    from concurrent.futures import ThreadPoolExecutor

    from orlhf.cpu.threads import apply_threads

    compute = ThreadPoolExecutor(1)

    def run(fn):
        def on_thread():
            apply_threads(threads)
            return fn()

        return compute.submit(on_thread).result()

    return run


def parse_value(kv: str) -> tuple[str, object]:
    k, v = kv.split("=", 1)
    low = v.lower()
    if low in ("true", "false"):
        return k, low == "true"
    try:
        return k, int(v)
    except ValueError:
        try:
            return k, float(v)
        except ValueError:
            return k, v


if __name__ == "__main__":
    main()
