"""LoRA and QLoRA actors on one GPU, without Ray or vLLM (scripts/gpu_check.sh runs them).

- a bf16 LoRA train step (ZeRO-3) moves only the adapter, and the merged weights a sync sends give the trainer's
  log-probs in a plain transformers model (up to bf16 noise)
- QLoRA (--load_in_4bit, ZeRO-2, bitsandbytes): the step runs, the base stays 4-bit, and the sync sends every
  quantized module dequantized, so a plain bf16 model built from them scores as the trainer does

Marked `gpu` (skipped without CUDA); QLoRA also needs bitsandbytes (the gpu extra).
"""

import importlib.util

import pytest
import torch
from gpu_helpers import A, padded_batch
from test_workers_gpu import actor_cfg, experience, hf_log_probs, masked_mean_abs, started

gpu = pytest.mark.gpu
LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def synced_model(worker, path: str):
    """A plain bf16 transformers model holding what a sync sends (every other weight from the folder)."""
    from transformers import AutoModelForCausalLM

    worker.weight_groups_meta(LLAMA_PACKED)
    sent = {n: t for group in worker.sync_groups(to_cpu=True, copy=True) for n, t in group}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    missing = set(sent) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(sent, strict=False)
    return model, sent


@gpu
def test_lora_bf16_step_moves_the_adapter_and_the_sync_carries_it(dist_env, lm_path):
    from orlhf.config.worker_slices import LoraSlice

    exp = experience(lm_path)
    worker = started(actor_cfg(lm_path, lora=LoraSlice(rank=8, alpha=16)))
    before = worker.log_probs(exp.as_sequence_batch())
    worker.train_step(exp)
    after = worker.log_probs(exp.as_sequence_batch())
    base = worker.base_log_probs(exp.as_sequence_batch())
    model, sent = synced_model(worker, lm_path)
    synced = hf_log_probs(model, exp.as_sequence_batch())
    mask = exp.action_mask
    moved, gap = masked_mean_abs(after - before, mask), masked_mean_abs(synced - after, mask)
    print(f"\n[lora bf16] moved {moved:.3f}, synced model - trainer {gap:.4f}, {len(sent)} tensors sent")
    assert moved > 0.05
    assert gap < 0.25 * moved
    assert masked_mean_abs(base - before, mask) < 0.25 * moved  # adapter off: back to the start (B was 0)


@gpu
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (the gpu extra)")
def test_qlora_step_runs_on_4bit_weights_and_the_sync_dequantizes_them(dist_env, lm_path):
    from orlhf.config.worker_slices import LoraSlice

    exp = experience(lm_path)
    worker = started(actor_cfg(lm_path, zero_stage=2, lora=LoraSlice(rank=8, alpha=16, load_in_4bit=True)))
    quantized = [n for n, p in worker.module.named_parameters() if type(p).__name__ == "Params4bit"]
    assert quantized, "no 4-bit weights: --load_in_4bit did not quantize"
    before = worker.log_probs(exp.as_sequence_batch())
    stats = worker.train_step(exp)
    after = worker.log_probs(exp.as_sequence_batch())
    model, sent = synced_model(worker, lm_path)
    synced = hf_log_probs(model, exp.as_sequence_batch())
    mask = exp.action_mask
    moved, gap = masked_mean_abs(after - before, mask), masked_mean_abs(synced - after, mask)
    print(f"\n[qlora] loss {stats.loss:.4f}, moved {moved:.3f}, synced model - trainer {gap:.4f}")
    assert len(sent) >= len(quantized)  # every quantized weight goes, adapted or not
    assert moved > 0.05
    assert gap < 0.25 * moved
    assert padded_batch().sequences.shape[1] >= A
