"""How much of a model changes per update, in the engines' dtype: what a delta weight sync would send.

In-process, no Ray, no DeepSpeed: a plain transformers model in fp32 (the trainer's master weights) and torch's
AdamW with orlhf's defaults (betas 0.9/0.95, no weight decay), stepped on the recipe's kind of batch (its prompts,
tokenized as a run tokenizes them, each followed by --gen_tokens response tokens drawn from the prompts' own tokens,
a policy-gradient loss with random +-1 advantages per sample). That is what the actor's weights do from one update
to the next; the engines hold those weights cast to their dtype.

    per model (demo: Llama untied, Llama tied, Qwen2-MoE; real: SmolLM2-135M) and learning rate:
      fresh model -> N steps; after each step, per tensor: elements whose bf16 (fp32) value changed
      bytes a delta needs, per encoding (v = engine dtype bytes, n = elements, k = changed):
        idx     int32 indices + values: k * (4 + v), per tensor dense (n * v) where denser
        mask    a bitmask + values:     n / 8 + k * v, per tensor dense where denser
        full    the whole model in the engine dtype: n * v (what a full sync in the engine dtype sends;
                an fp32 trainer sends n * 4 today and the engine casts)

Reproduce (2-core CPU; the real model needs `orlhf make-demo --real` once, ~1 min per learning rate):
    PYTHONPATH=$PWD python benchmarks/bench_delta_sync.py --models demo demo_tied demo_moe real --steps 4
Results: benchmarks/results/2026-12-02-delta-sync-measure.md. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE_LR = {"demo": 5e-4, "demo_tied": 5e-4, "demo_moe": 5e-4, "real": 1e-5}  # config/flags.py, demo/arith.py
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_model(name: str, cache: Path | None):
    """(model in fp32, prompts as token-id lists, samples per prompt, response tokens) for a model name."""
    import transformers

    from orlhf.demo.builder import _build_model, _build_tokenizer

    if name.startswith("demo"):
        tok = _build_tokenizer(random.Random(0))
        model = _build_model(tok, 0, moe=name == "demo_moe")
        if name == "demo_tied":  # the demo's Llama with its head tied to the embedding
            cfg = model.config
            cfg.tie_word_embeddings = True
            model = transformers.LlamaForCausalLM(cfg)
        from orlhf.demo.builder import _prompt_rows

        prompts = [tok(r["prompt"])["input_ids"] for r in _prompt_rows(random.Random(0))]
        return model.float(), prompts, 1, 24  # demo preset: 64 prompts, 24 new tokens
    from orlhf.demo.arith import rows, split_pairs
    from orlhf.demo.real_model import ensure_real_model

    folder = ensure_real_model(cache)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    qs = [r["question"] for r in rows(split_pairs(0)[0][:8])]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in qs]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    return model, prompts, 8, 24  # recipe: 8 prompts x 8 samples, 24 new tokens


def make_batch(prompts: list[list[int]], samples: int, gen: int, seed: int):
    """(sequences (B, T), response mask (B, T-1), advantages (B,)): each prompt `samples` times, each followed by
    `gen` tokens drawn from the prompts' tokens; right-padded with the first token (masked out)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(sorted({t for p in prompts for t in p}))
    rows = [p + pool[torch.randint(len(pool), (gen,), generator=g)].tolist() for p in prompts for _ in range(samples)]
    width = max(map(len, rows))
    seqs = torch.full((len(rows), width), rows[0][0])
    mask = torch.zeros(len(rows), width - 1)
    for i, r in enumerate(rows):
        seqs[i, : len(r)] = torch.tensor(r)
        mask[i, len(r) - 1 - gen : len(r) - 1] = 1
    adv = torch.randint(0, 2, (len(rows),), generator=g).float() * 2 - 1
    return seqs, mask, adv


def pg_step(model, opt, batch, micro: int) -> None:
    seqs, mask, adv = batch
    opt.zero_grad(set_to_none=True)
    for s in range(0, len(seqs), micro):
        x, m, a = seqs[s : s + micro], mask[s : s + micro], adv[s : s + micro]
        logp = torch.log_softmax(model(x).logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -((logp * m).sum(1) / m.sum(1) * a).sum() / len(seqs)
        loss.backward()
    opt.step()


def tensor_bytes(n: int, k: int, v: int) -> dict[str, int]:
    return {"idx": min(k * (4 + v), n * v), "mask": min((n + 7) // 8 + k * v, n * v), "full": n * v}


def measure(model, held: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Per engine dtype: changed fraction and bytes per encoding since `held` (updated in place)."""
    out = {}
    for dname, dtype in DTYPES.items():
        tot = {"n": 0, "k": 0, "idx": 0, "mask": 0, "full": 0}
        v = torch.empty((), dtype=dtype).element_size()
        for name, p in model.named_parameters():  # tied weights appear once
            new = p.detach().to(dtype).clone()
            bits = torch.int16 if v == 2 else torch.int32
            k = int((new.view(bits) != held[dname][name].view(bits)).sum())
            held[dname][name] = new
            for key, b in tensor_bytes(new.numel(), k, v).items():
                tot[key] += b
            tot["n"] += new.numel()
            tot["k"] += k
        out[dname] = {"changed": tot["k"] / tot["n"], **{e: tot[e] for e in ("idx", "mask", "full")}}
    return out


def run(name: str, lr: float, steps: int, cache) -> dict:
    model, prompts, samples, gen = load_model(name, cache)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    held = {d: {n: p.detach().to(t).clone() for n, p in model.named_parameters()} for d, t in DTYPES.items()}
    per_step = []
    for step in range(steps):
        t0 = time.perf_counter()
        pg_step(model, opt, make_batch(prompts, samples, gen, seed=step), micro=16)
        per_step.append({"step": step + 1, "train_s": round(time.perf_counter() - t0, 2), **measure(model, held)})
        print(json.dumps({"model": name, "lr": lr, **per_step[-1]}), flush=True)
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "lr": lr, "params": params, "steps": per_step}


def table(results: list[dict]) -> str:
    lines = [
        "| model | lr | params | engine | changed (min-max over steps) | idx / full | mask / full |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for d in DTYPES:
            ch = [s[d]["changed"] for s in r["steps"]]
            idx = [s[d]["idx"] / s[d]["full"] for s in r["steps"]]
            mask = [s[d]["mask"] / s[d]["full"] for s in r["steps"]]
            lines.append(
                f"| {r['model']} | {r['lr']:g} | {r['params'] / 1e6:.2f}M | {d} | {min(ch):.2%} - {max(ch):.2%} | "
                f"{min(idx):.3f} - {max(idx):.3f} | {min(mask):.3f} - {max(mask):.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["demo", "demo_tied", "demo_moe", "real"])
    ap.add_argument("--lrs", nargs="+", default=["recipe", "1e-6", "1e-5"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared, loaded machine)")
    ap.add_argument("--cache", type=Path, default=None, help="orlhf's cache (default: ORLHF_CACHE or ~/.cache/orlhf)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    results = []
    for name in args.models:
        lrs = []
        for lr in args.lrs:
            value = RECIPE_LR[name] if lr == "recipe" else float(lr)
            if value not in lrs:
                lrs.append(value)
        results += [run(name, lr, args.steps, args.cache) for lr in lrs]
    print(table(results))
    summary = {
        f"{r['model']}@{r['lr']:g}": {d: round(max(s[d]["changed"] for s in r["steps"]), 5) for d in DTYPES}
        for r in results
    }
    print(json.dumps({"bench": "delta_sync", "steps": args.steps, "max_changed": summary}))


if __name__ == "__main__":
    main()
