"""DeepSpeed workers on one GPU, without Ray or vLLM: what one GPU can prove about orlhf's trainer side.

- a ZeRO-3 bf16 PPO train step equals plain HF (fp32 AdamW, same loss, same clipping) up to bf16 noise
- the optimizer chosen for CUDA: FusedAdam under --deepspeed_enable_sleep, torch AdamW otherwise
- offload_states / reload_states: device memory drops, and weights and Adam states come back bit-equal
- --packing_samples equals the padded batch on GPU kernels (SDPA; flash-attn 2 when importable)
- each distinct prompt run once (the default) equals whole rows on the same kernels
- `orlhf plan`'s per-GPU estimate against torch.cuda.max_memory_allocated at three sizes (ratio reported)

GPU tests are marked `gpu` (skipped without CUDA); the plan helper's arithmetic also runs on CPU.
"""

import dataclasses
import gc
import importlib.util

import pytest
import torch
from gpu_helpers import A, B, gpu_report, padded_batch, tiny_llama

gpu = pytest.mark.gpu
LR = 1e-2  # large enough that one Adam step moves log-probs well past bf16 noise


def actor_cfg(path: str, **kw):
    from orlhf.config.worker_config import role_config

    base = dict(
        model_path=path,
        device="cuda",
        zero_stage=3,
        bf16=True,
        micro_forward_batch_size=B,
        learning_rate=LR,
        train_batch_size=B,
        micro_train_batch_size=B,
        total_optimizer_steps=4,
    )
    return role_config("actor", **{**base, **kw})


def experience(model_path: str):
    """A batch whose old log-probs come from the fp32 HF model on GPU (the reference policy of step one)."""
    from orlhf.types import Experience

    batch = padded_batch()
    old = hf_log_probs(hf_model(model_path), batch)
    adv = torch.randn(B, A, generator=torch.Generator().manual_seed(7))
    return Experience(batch.sequences, batch.attention_mask, batch.action_mask, action_log_probs=old, advantages=adv)


def hf_model(path: str, dtype=torch.float32, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).cuda()
    model.config.use_cache = False
    return model


def to_cuda(batch):
    """A SequenceBatch on the GPU (the workers move their inputs themselves; plain HF needs it done)."""
    return dataclasses.replace(
        batch, **{f: getattr(batch, f).cuda() for f in ("sequences", "attention_mask", "action_mask")}
    )


def hf_log_probs(model, batch, packed: bool = False) -> torch.Tensor:
    from orlhf.workers.causal_lm import action_logits, gather_log_probs

    b = to_cuda(batch)
    with torch.no_grad():
        return gather_log_probs(action_logits(model, b, 1.0, packed), b.sequences[:, -A:]).float().cpu()


def started(cfg):
    from orlhf.workers import PolicyWorker

    worker = PolicyWorker(cfg)
    worker.init()
    return worker


def masked_mean_abs(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x.abs() * mask).sum() / mask.sum())


@gpu
def test_zero3_bf16_train_step_matches_plain_hf(dist_env, lm_path):
    from orlhf.algo.losses import policy_loss
    from orlhf.workers.causal_lm import action_logits, gather_log_probs

    exp = experience(lm_path)
    mask = exp.action_mask
    worker = started(actor_cfg(lm_path))
    stats = worker.train_step(exp)
    ds_after = worker.log_probs(exp.as_sequence_batch())

    model = hf_model(lm_path)
    before = hf_log_probs(model, exp.as_sequence_batch())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=actor_cfg(lm_path).train.adam_betas, weight_decay=0.0)
    batch = to_cuda(exp.as_sequence_batch())
    lp = gather_log_probs(action_logits(model, batch, 1.0), batch.sequences[:, -A:])
    loss, _ = policy_loss(lp, exp.action_log_probs.cuda(), exp.advantages.cuda(), mask.cuda(), 0.2, None)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's gradient_clipping 1.0
    opt.step()
    hf_after = hf_log_probs(model, exp.as_sequence_batch())

    moved = masked_mean_abs(hf_after - before, mask)
    gap = masked_mean_abs(ds_after - hf_after, mask)
    gpu_report(
        "train_step_parity", {"loss_ds": stats.loss, "loss_hf": loss.item(), "logprob_move": moved, "ds_vs_hf_gap": gap}
    )
    assert abs(stats.loss - loss.item()) < 2e-2
    assert moved > 0.05, "one step must move the log-probs, or the comparison proves nothing"
    assert gap < 0.25 * moved


@gpu
@pytest.mark.parametrize("offload", [False, True], ids=["adamw", "fused_adam_for_offload"])
def test_optimizer_chosen_for_cuda(dist_env, lm_path, offload):
    from deepspeed.ops.adam import FusedAdam

    worker = started(actor_cfg(lm_path, offload_states=offload))
    inner = worker.engine.optimizer.optimizer  # ZeRO-3 wraps the client optimizer
    assert type(inner) is (FusedAdam if offload else torch.optim.AdamW)
    stats = worker.train_step(experience(lm_path))
    assert torch.isfinite(torch.tensor(stats.loss))


@gpu
def test_offload_and_reload_states_round_trip(dist_env, lm_path):
    worker = started(actor_cfg(lm_path, offload_states=True))
    exp = experience(lm_path)
    worker.train_step(exp)  # Adam states exist from here on
    weights = {n: t.float().cpu().clone() for g in worker.named_full_weights(to_cpu=False) for n, t in g}
    inner = worker.engine.optimizer.optimizer
    adam = [{k: v.detach().cpu().clone() for k, v in s.items() if torch.is_tensor(v)} for s in inner.state.values()]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    assert worker.offload_states()
    torch.cuda.synchronize()
    freed = held - torch.cuda.memory_allocated()
    assert worker.reload_states()
    gpu_report("offload_states", {"held_mib": held / 2**20, "freed_mib": freed / 2**20})
    assert freed > 0
    after = {n: t.float().cpu() for g in worker.named_full_weights(to_cpu=False) for n, t in g}
    assert after.keys() == weights.keys() and all(torch.equal(after[n], weights[n]) for n in weights)
    adam_after = [{k: v.detach().cpu() for k, v in s.items() if torch.is_tensor(v)} for s in inner.state.values()]
    assert len(adam_after) == len(adam) > 0
    assert all(torch.equal(a[k], b[k]) for a, b in zip(adam, adam_after) for k in a)
    stats = worker.train_step(exp)  # and training goes on on the reloaded states
    assert torch.isfinite(torch.tensor(stats.loss))


ATTN = [
    "sdpa",
    pytest.param(
        "flash_attention_2",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not importable (the `flash` extra)"
        ),
    ),
]


@gpu
@pytest.mark.parametrize("attn", ATTN)
def test_packing_matches_padded(lm_path, attn):
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    model = hf_model(lm_path, dtype, attn)
    batch = padded_batch()
    padded, packed = hf_log_probs(model, batch), hf_log_probs(model, batch, packed=True)
    gap = float(((padded - packed).abs() * batch.action_mask).max())
    gpu_report("packing_parity", {"attn": attn, "max_gap": gap})
    assert gap <= (3e-2 if dtype == torch.bfloat16 else 1e-4)


@gpu
@pytest.mark.parametrize("attn", ATTN)
def test_shared_prompt_forward_matches_whole_rows(lm_path, attn):
    """Each distinct prompt run once (workers/shared_prompt.py) on GPU kernels: SDPA, and flash-attn 2 whose
    varlen path meets a query shorter than its keys (the response columns over the prompt's cache)."""
    from orlhf.workers.causal_lm import action_logits, gather_log_probs
    from orlhf.workers.shared_prompt import prompt_groups

    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    model = hf_model(lm_path, dtype, attn)
    batch = padded_batch()
    half = B // 2  # rows i and i + B/2 share row i's prompt: pairs of samples of one prompt, as GRPO's
    seq, mask = batch.sequences.clone(), batch.attention_mask.clone()
    seq[half:, :-A], mask[half:, :-A] = seq[:half, :-A], mask[:half, :-A]
    batch = dataclasses.replace(batch, sequences=seq, attention_mask=mask)
    assert prompt_groups(batch) is not None
    b = to_cuda(batch)
    with torch.no_grad():
        whole = gather_log_probs(action_logits(model, b, 1.0), b.sequences[:, -A:]).float().cpu()
        shared = gather_log_probs(action_logits(model, b, 1.0, shared=True), b.sequences[:, -A:]).float().cpu()
    gap = float(((whole - shared).abs() * batch.action_mask).max())
    gpu_report("shared_prompt_parity", {"attn": attn, "max_gap": gap})
    assert gap <= (3e-2 if dtype == torch.bfloat16 else 1e-4)


# ---- orlhf plan against the allocator ------------------------------------------------------------------------


def plan_estimate_bytes(model_dir: str, bf16: bool = True, zero_stage: int = 3, ranks: int = 1) -> float:
    """What `orlhf plan` says one actor rank holds on its GPU (model states only) for this model folder."""
    from orlhf.config.train_config import DeepSpeedConfig, TrainConfig
    from orlhf.launch.plan_memory import GIB, count_params, read_dims, role_memory

    cfg = dataclasses.replace(TrainConfig(), deepspeed=DeepSpeedConfig(bf16=bf16, zero_stage=zero_stage))
    return role_memory(cfg, "actor", count_params(read_dims(model_dir)), ranks, device="cuda").device_gib * GIB


def test_plan_estimate_counts_what_transformers_builds(tmp_path):
    """CPU: the estimate for the test models is 16 bytes (bf16 weight + grad, fp32 master + Adam m, v) per
    parameter plus DeepSpeed's reduce bucket (5e8 gradient elements, not sharded), and plan's parameter count
    equals the HF model's. Hand count for hidden 64, 2 layers, vocab 128:
    embeddings 8192 + 2 x (attention 4 x 64^2 + MLP 3 x 64 x 128 + norms 128 = 41088) + norm 64 + head 8192."""
    from transformers import AutoModelForCausalLM

    path = tiny_llama(tmp_path / "m")
    hand = 8192 + 2 * 41088 + 64 + 8192
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters()) == hand
    assert plan_estimate_bytes(path) == pytest.approx(16 * hand + 2 * 5e8)
    assert plan_estimate_bytes(path, bf16=False) == pytest.approx(16 * hand + 4 * 5e8)  # fp32: 4 + 4 + 8
    assert plan_estimate_bytes(path, ranks=2) == pytest.approx(8 * hand + 2 * 5e8)  # ZeRO-3 shards all three


@gpu
@pytest.mark.parametrize("hidden, layers", [(256, 2), (512, 4), (1024, 4)])
def test_plan_estimate_against_measured_peak(dist_env, tmp_path, hidden, layers):
    path = tiny_llama(tmp_path / f"m{hidden}", hidden=hidden, layers=layers)
    estimate = plan_estimate_bytes(path)
    exp = experience(path)  # before the measurement: it runs a plain HF model on the GPU
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    worker = started(actor_cfg(path))
    worker.train_step(exp)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    ratio = measured / estimate
    gpu_report(
        "plan_vs_measured",
        {
            "hidden": hidden,
            "layers": layers,
            "estimate_mib": estimate / 2**20,
            "measured_peak_mib": measured / 2**20,
            "measured_over_estimate": ratio,
        },
    )
    # The plan counts model states and the reduce bucket (activations and gathered layers come on top).
    assert ratio >= 0.9
    del worker
