"""The FLOPs each phase of a GRPO step spends, orlhf's layout against TRL's, on trl_compare.py's work; with a
trl_compare JSON result, the rate each phase ran at (its hybrid mode too: orlhf's forwards, HF generate).

What is counted (dense decoder, per position: 2 x the body's matrix weights, the attention products 4 x context x
hidden per layer, the LM head 2 x vocab x hidden where a position is scored; training = 3 x its forward):

    orlhf   generate  vLLM: each distinct prompt prefilled once (its samples share the blocks), every sampled token
                      decoded; the LM head on every decoded position
            score     the reference forward, workers/shared_prompt.py's layout: per micro-batch the common head of
                      its prompts once, each prompt's remainder once, each sample's response columns (padded to the
                      micro-batch's longest); the LM head on the response columns only
            train     the actor's forward + backward over the same layout (one optimizer step, no old-log-prob pass)
    TRL     generate  HF generate: every sample's prompt prefilled (left-padded to the batch's longest), every
                      sampled token decoded over the padded batch until its longest response ends
            score     the reference forward over every sample's padded prompt + completion, the LM head on the
                      completion columns (logits_to_keep)
            train     forward + backward over the same rows

Token counts come from the real prompts (the model's chat template, as both sides give it) and the mean response
length of the run (--response_len; from an orlhf metrics row's response_length in practice): the engine decodes
that many a sample; a forward's response columns run to the longest response, taken at the limit (a sampled batch's
longest at temperature 1; HF generate decodes the padded batch that long).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/probes/flop_profile.py --model DEMO/model --prompts DEMO/train.jsonl \\
        --input_key question --response_len 19 [--result runs/trl_compare/result.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    body: int  # matrix weights of the decoder layers (no embedding, no LM head)
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or h // heads
        attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
        return cls(h, layers, layers * (attn + 3 * h * inter), config.vocab_size)

    def forward(self, positions: float, context: float, scored: float) -> float:
        """FLOPs of a forward over `positions` attending to `context` positions on average, `scored` of them
        through the LM head."""
        return (
            positions * (2 * self.body + 4 * self.layers * context * self.hidden)
            + scored * 2 * self.vocab * self.hidden
        )


def orlhf_layout(prompts: list[list[int]], samples: int, micro: int, resp: float, limit: int) -> dict:
    """Positions of the shared-prompt forwards per step (prompt-major micro-batches of `micro` rows)."""
    per_mb = max(1, micro // samples)  # distinct prompts a micro-batch holds
    body = scored = 0.0
    for i in range(0, len(prompts), per_mb):
        group = prompts[i : i + per_mb]
        head = common_head(group) if len(group) > 1 else 0
        rest = max(len(p) - 1 - head for p in group)  # remainders left-padded to the longest (last column apart)
        cols = limit  # response columns from each prompt's last token: as many as the longest response
        body += head + len(group) * rest + len(group) * samples * cols
        scored += len(group) * samples * cols
    return {"positions": body, "scored": scored}


def trl_layout(prompts: list[list[int]], samples: int, resp: float, limit: int) -> dict:
    p = max(map(len, prompts))
    cols = limit  # the completion columns: as many as the longest
    rows = len(prompts) * samples
    return {"positions": rows * (p + cols), "scored": rows * cols, "prompt_cols": p}


def common_head(prompts: list[list[int]]) -> int:
    n = 0
    for column in zip(*prompts):
        if any(t != column[0] for t in column):
            break
        n += 1
    return min(n, min(len(p) for p in prompts) - 1)


def profile(shape: Shape, prompts: list[list[int]], samples: int, micro: int, resp: float, limit: int) -> dict:
    mean_p = sum(map(len, prompts)) / len(prompts)
    n = len(prompts) * samples
    decode = n * resp  # sampled tokens
    ctx_decode = mean_p + resp / 2
    o, t = orlhf_layout(prompts, samples, micro, resp, limit), trl_layout(prompts, samples, resp, limit)
    ctx = mean_p + resp / 2
    gen_orlhf = shape.forward(sum(map(len, prompts)), mean_p / 2, 0) + shape.forward(decode, ctx_decode, decode)
    trl_decode = n * limit  # the padded batch runs until its longest response ends
    gen_trl = shape.forward(n * t["prompt_cols"], t["prompt_cols"] / 2, 0) + shape.forward(trl_decode, ctx, trl_decode)
    out = {
        "orlhf": {
            "generate": gen_orlhf,
            "score": shape.forward(o["positions"], ctx, o["scored"]),
            "train": 3 * shape.forward(o["positions"], ctx, o["scored"]),
            "positions": o["positions"],
        },
        "trl": {
            "generate": gen_trl,
            "score": shape.forward(t["positions"], ctx, t["scored"]),
            "train": 3 * shape.forward(t["positions"], ctx, t["scored"]),
            "positions": t["positions"],
        },
    }
    return out


def templated(model: str, prompts_file: str, key: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line)[key] for line, _ in zip(open(prompts_file), range(count))]
    ids = [tok.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True) for r in rows]
    return [list(x["input_ids"]) if not isinstance(x, list) else x for x in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--input_key", default="question")
    ap.add_argument("--prompts_per_step", type=int, default=16)
    ap.add_argument("--samples_per_prompt", type=int, default=4)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--new_tokens", type=int, default=24)
    ap.add_argument("--response_len", type=float, required=True, help="mean sampled tokens per response")
    ap.add_argument("--result", type=Path, default=None, help="a trl_compare JSON line: seconds per phase")
    a = ap.parse_args()
    from transformers import AutoConfig

    shape = Shape.of(AutoConfig.from_pretrained(a.model))
    prompts = templated(a.model, a.prompts, a.input_key, a.prompts_per_step)
    prof = profile(shape, prompts, a.samples_per_prompt, a.micro_batch, a.response_len, a.new_tokens)
    seconds = {}
    if a.result:
        modes = json.loads(a.result.read_text().strip().splitlines()[-1])["modes"]
        seconds = {m: r.get("phases", {}) for m, r in modes.items()}
        if "hybrid" in modes:  # trl_compare's hybrid mode: orlhf's forwards, HF generate over the padded batch
            prof["hybrid"] = {**prof["orlhf"], "generate": prof["trl"]["generate"]}
    print(
        f"prompt tokens {sum(map(len, prompts)) / len(prompts):.1f} mean, common head of the step's prompts "
        f"{common_head(prompts)}; body matrix weights {shape.body / 1e6:.1f}M, "
        f"LM head {shape.vocab * shape.hidden / 1e6:.1f}M"
    )
    print("| side | phase | GFLOP | positions through the body | s | GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for side, phases in prof.items():
        timed = dict(seconds.get(side, {}))
        rows = [(p, phases[p]) for p in ("generate", "score", "train")]
        if "generate_score" in timed:  # TRL times generation and the reference forward as one phase
            rows = [("generate + score", phases["generate"] + phases["score"]), ("train", phases["train"])]
            timed["generate + score"] = timed.pop("generate_score")
        for phase, flop in rows:
            s = timed.get(phase)
            rate = f"{flop / 1e9 / s:.0f}" if s else "-"
            pos = f"{phases['positions']:.0f}" if phase in ("score", "train") else "-"
            print(f"| {side} | {phase} | {flop / 1e9:.0f} | {pos} | {'-' if s is None else round(s, 2)} | {rate} |")
    print(
        json.dumps(
            {side: {k: round(v / 1e9, 1) if k != "positions" else v for k, v in p.items()} for side, p in prof.items()}
        )
    )


if __name__ == "__main__":
    main()
