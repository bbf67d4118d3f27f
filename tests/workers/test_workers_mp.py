"""Model workers on real process groups (gloo, no Ray): ZeRO-3 results equal a plain HF model on the same weights.

Two spawns serve every test (process start and DeepSpeed init dominate the cost): one at world size 2 and one
at world size 1. Each rank runs a fixed script of worker calls and writes what it saw to <tmp>/<job>_rank<r>.pt;
the tests below compare those results with plain transformers forwards computed here in the parent.
"""

import dataclasses
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks

from orlhf.config.worker_config import WorkerConfig, role_config
from orlhf.types import Experience, SequenceBatch

B, P, A, V = 8, 6, 5, 128  # global batch, prompt length, response length, vocab
PAD = 0


# ---------------------------------------------------------------- fixtures built in the parent


def _tiny_llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=V,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("workers")
    lm, rm = root / "lm", root / "rm"
    torch.manual_seed(0)
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(lm)
    _tiny_tokenizer().save_pretrained(lm)
    torch.manual_seed(1)
    LlamaForSequenceClassification(_tiny_llama_config(num_labels=1)).save_pretrained(rm)
    return {"root": root, "lm": str(lm), "rm": str(rm)}


def _make_batch() -> SequenceBatch:
    """Left-padded prompts (1..P real tokens) + right-padded responses (1..A real tokens); pad id 0 only on pads."""
    g = torch.Generator().manual_seed(123)
    seq = torch.randint(4, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    for i in range(B):
        attn[i, : i % P] = 0  # prompt i has P - i % P real tokens
        attn[i, P + 1 + (i * 3) % A :] = 0  # response i has 1 + 3i % A real tokens
    seq[attn == 0] = PAD
    return SequenceBatch(seq, attn, attn[:, -A:].bool())


def _grouped(exp: Experience) -> Experience:
    """exp with row 2k+1's prompt replaced by row 2k's: pairs of samples of one prompt, as GRPO's."""
    seq, attn = exp.sequences.clone(), exp.attention_mask.clone()
    seq[1::2, :P], attn[1::2, :P] = seq[0::2, :P], attn[0::2, :P]
    return dataclasses.replace(exp, sequences=seq, attention_mask=attn)


def _positions(attn):
    return (attn.cumsum(-1) - 1).clamp(min=0)


def _hf_log_probs(model, batch: SequenceBatch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(
            input_ids=batch.sequences,
            attention_mask=batch.attention_mask,
            position_ids=_positions(batch.attention_mask),
        ).logits
    lp = torch.log_softmax(logits[:, -A - 1 : -1].float(), -1)
    return lp.gather(-1, batch.sequences[:, -A:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def hf_lm(paths):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(paths["lm"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def experience(hf_lm) -> Experience:
    batch = _make_batch()
    old = _hf_log_probs(hf_lm, batch)
    g = torch.Generator().manual_seed(7)
    return Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=old,
        advantages=torch.randn(B, A, generator=g),
        returns=torch.randn(B, A, generator=g),
        values=0.1 * torch.randn(B, A, generator=g),
        base_action_log_probs=old - 0.1 * torch.rand(B, A, generator=g),
    )


# ---------------------------------------------------------------- what each rank runs


def _cfg(role: str, path: str, **kw) -> WorkerConfig:
    train = dict(learning_rate=1e-3, train_batch_size=B, micro_train_batch_size=2, total_optimizer_steps=4)
    loss = dict(entropy_loss_coef=0.01, use_kl_loss=True, kl_coef=0.1, kl_estimator="k3") if role == "actor" else {}
    base = dict(model_path=path, device="cpu", zero_stage=3, micro_forward_batch_size=3)
    critic = {"value_clip": 0.5} if role == "critic" else {}
    return role_config(role, **{**base, **(train if role in ("actor", "critic") else {}), **loss, **critic, **kw})


def _timed(out: dict, key: str, fn):
    t = time.perf_counter()
    result = fn()
    out[f"time/{key}"] = time.perf_counter() - t
    return result


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _ws2(rank: int, out: dict, paths: dict, exp: Experience) -> None:
    from orlhf.workers import CriticWorker, PolicyWorker, RewardWorker

    half = exp.split([B // 2, B // 2])[rank]
    # Uneven forward shares on purpose: rank 0 scores all 8 rows (3 micro-batches), rank 1 the first 4 (2).
    fwd = exp.as_sequence_batch() if rank == 0 else exp.as_sequence_batch().split([4, 4])[0]
    actor = PolicyWorker(_cfg("actor", paths["lm"]))
    _timed(out, "actor_init", actor.init)
    out["log_probs"] = actor.log_probs(fwd)
    out["weights"] = [[(n, None if t is None else tuple(t.shape)) for n, t in g] for g in actor.named_full_weights()]
    out["before"] = actor.state_dict_full()
    out["stats"] = _timed(out, "train_step", lambda: actor.train_step(half))
    out["after"] = actor.state_dict_full()
    _timed(out, "train_step_2", lambda: actor.train_step(half))
    out["rss_mb_actor"] = _rss_mb()
    out["shared_prompt"] = actor.shared_prompt  # ZeRO-3 over 2 ranks: off (see causal_lm.shares_prompts)
    out["saved"] = actor.state_dict_full()
    actor.save_hf(str(paths["root"] / "export"))

    critic = CriticWorker(_cfg("critic", paths["lm"]))
    critic.init()
    out["values"] = critic.values(fwd)
    out["critic_weights"] = critic.state_dict_full()
    out["critic_stats"] = _timed(out, "critic_step", lambda: critic.train_step(half))

    reward = RewardWorker(_cfg("reward", paths["rm"]))
    reward.init()
    out["scores"] = reward.scores(fwd)
    out["rss_mb_all"] = _rss_mb()

    bf16 = PolicyWorker(_cfg("actor", paths["lm"], bf16=True))  # ZeRO-3 over 2 ranks: each writes its partition
    bf16.init()
    out["bf16_zero3_masters"] = _masters(bf16)


def _ws1(rank: int, out: dict, paths: dict, exp: Experience) -> None:
    from orlhf.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker

    actor = PolicyWorker(_cfg("actor", paths["lm"]))
    actor.init()
    out["stats"] = actor.train_step(exp)
    out["after"] = actor.state_dict_full()

    # A single pass (one optimizer step per batch, TrainConfig.single_pass): no old log-probs in the experience,
    # the actor's own detached training log-probs stand in; the engines' (here: shifted by 0.25) give the gap.
    single = PolicyWorker(_cfg("actor", paths["lm"]))
    single.init()
    shifted = exp.action_log_probs + 0.25 * exp.action_mask
    out["single_stats"] = single.train_step(dataclasses.replace(exp, action_log_probs=None, rollout_log_probs=shifted))
    out["single_after"] = single.state_dict_full()

    plain = PolicyWorker(_cfg("actor", paths["lm"], zero_stage=0))  # no ZeRO: DeepSpeed's plain data parallel
    plain.init()
    out["stage0_stats"] = plain.train_step(exp)
    out["stage0_after"] = plain.state_dict_full()
    out["stage0_empty"] = plain.log_probs(exp.as_sequence_batch().split([0, B])[0])
    out["stage0_allreduce"] = plain.engine.enable_backward_allreduce

    # bf16 without ZeRO (the one-rank default with --bf16): DeepSpeed's BF16_Optimizer keeps the fp32 master weights
    # and accumulates the gradients in fp32 outside the all-reduce that one rank skips.
    bf16_plain = PolicyWorker(_cfg("actor", paths["lm"], zero_stage=0, bf16=True))
    bf16_plain.init()
    out["bf16_stage0_masters"] = _masters(bf16_plain)
    before = {k: v.clone() for k, v in bf16_plain.state_dict_full().items()}
    out["bf16_stage0_stats"] = bf16_plain.train_step(exp)
    out["bf16_stage0_moved"] = _max_diff(bf16_plain.state_dict_full(), before)

    bf16 = PolicyWorker(_cfg("actor", paths["lm"], zero_stage=2, bf16=True, gradient_checkpointing=True))
    bf16.init()
    out["bf16_stage2_masters"] = _masters(bf16)
    out["bf16_attn"] = bf16.module.config._attn_implementation  # a bf16 model that trains on CPU: fp32 SDPA
    out["bf16_stats"] = bf16.train_step(exp)

    offload = PolicyWorker(_cfg("actor", paths["lm"], adam_offload=True))
    offload.init()
    out["offload_stats"] = _timed(out, "offload_step", lambda: offload.train_step(exp))
    out["offload_after"] = offload.state_dict_full()

    ref = ReferenceWorker(_cfg("ref", paths["lm"], zero_stage=2))  # frozen under ZeRO-1/2 runs as stage 0
    ref.init()
    out["ref_log_probs"] = ref.log_probs(exp.as_sequence_batch())
    out["ref_weights"] = [[(n, None if t is None else tuple(t.shape)) for n, t in g] for g in ref.named_full_weights()]

    critic = CriticWorker(_cfg("critic", paths["rm"]))
    critic.init()
    out["rm_critic_values"] = critic.values(exp.as_sequence_batch())

    # Padding removal on and off: the same step (trimming is the default above; packing and padded here).
    for name, kw in (("padded", {"trim_padding": False}), ("packed", {"packing_samples": True})):
        worker = PolicyWorker(_cfg("actor", paths["lm"], **kw))
        worker.init()
        out[f"{name}_log_probs"] = worker.log_probs(exp.as_sequence_batch())
        out[f"{name}_stats"] = worker.train_step(exp)
        out[f"{name}_after"] = worker.state_dict_full()
    packed_critic = CriticWorker(_cfg("critic", paths["rm"], packing_samples=True))
    packed_critic.init()
    out["packed_rm_critic_values"] = packed_critic.values(exp.as_sequence_batch())
    out["packed_critic_stats"] = packed_critic.train_step(exp)
    packed_reward = RewardWorker(_cfg("reward", paths["rm"], packing_samples=True))
    packed_reward.init()
    out["packed_scores"] = packed_reward.scores(exp.as_sequence_batch())

    # Each distinct prompt run once (the default) against every row run whole, on rows that share prompts.
    grouped = _grouped(exp)
    out["zero3_flags"] = (actor.shared_prompt, actor.shared_prompt_train, ref.shared_prompt)
    out["ref_grouped"] = ref.log_probs(grouped.as_sequence_batch())
    unshared = {"zero_stage": 2, "shared_prompt": False}
    for name, kw in (("shared", {"zero_stage": 2}), ("shared3", {}), ("unshared", unshared), ("reordered", unshared)):
        worker = PolicyWorker(_cfg("actor", paths["lm"], **kw))
        worker.init()
        out[f"{name}_flags"] = (worker.shared_prompt, worker.shared_prompt_train)
        out[f"{name}_log_probs"] = worker.log_probs(grouped.as_sequence_batch())
        # reordered: the controller's prompt-major shuffle (one optimizer step: the order cannot change it)
        rows = grouped.index(torch.tensor([6, 7, 2, 3, 0, 1, 4, 5])) if name == "reordered" else grouped
        out[f"{name}_stats"] = worker.train_step(rows)
        out[f"{name}_after"] = worker.state_dict_full()
    for name, kw in (("shared", {}), ("unshared", {"shared_prompt": False})):
        critic = CriticWorker(_cfg("critic", paths["rm"], zero_stage=2, **kw))
        critic.init()
        out[f"critic_{name}_flags"] = (critic.shared_prompt, critic.shared_prompt_train)
        out[f"critic_{name}_values"] = critic.values(grouped.as_sequence_batch())
        out[f"critic_{name}_stats"] = critic.train_step(grouped)
        out[f"critic_{name}_after"] = critic.state_dict_full()
        reward = RewardWorker(_cfg("reward", paths["rm"], **kw))  # ZeRO-3, one rank
        reward.init()
        out[f"rm_{name}_flag"] = reward.shared_prompt
        out[f"rm_{name}_scores"] = reward.scores(grouped.as_sequence_batch())


def _masters(worker) -> dict[str, torch.Tensor]:
    """{name: the fp32 master DeepSpeed steps} of a bf16 worker's trained parameters (all ranks: collective under
    ZeRO-3), through DeepSpeed's accessor or, without ZeRO, its unfused optimizer's copies (workers/fp32_masters.py)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from orlhf.workers.fp32_masters import _unfused_masters

    unfused = _unfused_masters(worker.engine.optimizer)
    out = {}
    for name, p in worker.engine.module.named_parameters():
        hp = unfused.get(id(p)) if id(p) in unfused else safe_get_full_fp32_param(p)
        out[name] = hp.detach().float().cpu().clone()
    return out


def _rank_main(rank: int, world: int, port: int, job: str, paths: dict, exp: Experience, out_dir: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    out: dict = {}
    {"ws2": _ws2, "ws1": _ws1}[job](rank, out, paths, exp)
    torch.save(out, Path(out_dir) / f"{job}_rank{rank}.pt")


def _spawn(job: str, world: int, paths: dict, exp: Experience) -> list[dict]:
    out_dir = paths["root"] / job
    out_dir.mkdir()
    spawn_ranks(_rank_main, world, job, paths, exp, str(out_dir))
    return [torch.load(out_dir / f"{job}_rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def ws2(paths, experience):
    return _spawn("ws2", 2, paths, experience)


@pytest.fixture(scope="module")
def ws1(paths, experience):
    return _spawn("ws1", 1, paths, experience)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------- pure helpers (no processes)


def test_ds_config_batch_sizes_and_frozen_stage():
    from orlhf.workers.deepspeed_setup import ds_config

    c = ds_config(_cfg("actor", "x", train_batch_size=16, micro_train_batch_size=2, adam_offload=True), world_size=2)
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (16, 2, 4)
    assert c["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}  # no pinning on CPU
    with pytest.raises(ValueError, match="multiple of micro_train_batch_size 2 x world size 3"):
        ds_config(_cfg("actor", "x", train_batch_size=16, micro_train_batch_size=2), world_size=3)
    frozen = ds_config(_cfg("ref", "x", zero_stage=2, param_offload=True), world_size=2)
    assert frozen["zero_optimization"] == {"stage": 0} and frozen["train_micro_batch_size_per_gpu"] == 3
    assert ds_config(_cfg("reward", "x", param_offload=True), 1)["zero_optimization"] == {"stage": 3}  # CPU: no-op


def test_lr_schedule_warms_up_then_decays_to_ten_percent():
    from orlhf.workers.deepspeed_setup import lr_factor

    # warm-up 4 steps: 1/4, 2/4, 3/4, 4/4; then cosine over the remaining 10 - 4 = 6 steps down to 0.1:
    # step 7 is halfway: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55; step 10 and later: 0.1
    assert [lr_factor(s, 4, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(7, 4, 10) == pytest.approx(0.55)
    assert lr_factor(10, 4, 10) == pytest.approx(0.1) and lr_factor(50, 4, 10) == pytest.approx(0.1)
    assert lr_factor(0, 0, 1) == 1.0  # no warm-up: the first step runs at the peak LR


# ---------------------------------------------------------------- the checks


def test_zero3_log_probs_equal_plain_hf(ws2, hf_lm, experience):
    expected = _hf_log_probs(hf_lm, experience.as_sequence_batch())  # (B, A)
    r0, r1 = ws2[0]["log_probs"], ws2[1]["log_probs"]
    assert r0.shape == (B, A) and r1.shape == (4, A) and r0.dtype == torch.float32
    mask = experience.action_mask  # padding positions are not scored (trimmed micro-batches leave zeros there)
    assert (r0 - expected)[mask].abs().max().item() <= 1e-5
    assert (r1 - expected[:4])[mask[:4]].abs().max().item() <= 1e-5


def test_stage0_reference_log_probs_equal_plain_hf(ws1, hf_lm, experience):
    expected = _hf_log_probs(hf_lm, experience.as_sequence_batch())
    assert (ws1[0]["ref_log_probs"] - expected)[experience.action_mask].abs().max().item() <= 1e-5


def test_train_step_changes_parameters_and_loss_is_finite(ws2, hf_lm):
    stats, before, after = ws2[0]["stats"], ws2[0]["before"], ws2[0]["after"]
    assert ws2[1]["before"] is None and ws2[1]["after"] is None  # full state dicts live on rank 0 only
    assert _max_diff(before, {k: v for k, v in hf_lm.state_dict().items()}) == 0.0  # loaded exactly
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert math.isfinite(stats.kl_loss) and stats.entropy > 0 and stats.micro_steps == 2
    assert stats.lr == pytest.approx(1e-3 / 1)  # warm-up ratio 0: the first step runs at the peak LR
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))}"


def test_train_step_world_size_2_equals_world_size_1(ws2, ws1):
    # Global batch 8, micro 2: ws1 averages micro-batches [0:2] .. [6:8]; ws2 rank r averages its two micro-
    # batches of [4r:4r+4] and the ranks average their gradients: the same mean of the same four micro means.
    assert _max_diff(ws2[0]["after"], ws1[0]["after"]) <= 1e-5


def test_named_full_weights_cover_the_hf_model_once(ws2, ws1, hf_lm):
    expected = {k: tuple(v.shape) for k, v in hf_lm.state_dict().items()}
    for weights in (ws2[0]["weights"], ws1[0]["ref_weights"]):  # ZeRO-3 at world 2, and stage 0
        names = [n for g in weights for n, _ in g]
        assert len(names) == len(set(names)) and dict(n_s for g in weights for n_s in g) == expected
        # Grouping: one group per decoder layer, plus one for embeddings / final norm / LM head.
        layers = [{n.split(".")[2] for n, _ in g if n.startswith("model.layers.")} for g in weights]
        assert sorted(len(g) for g in weights) == [3, 9, 9] and sum(1 for s in layers if len(s) == 1) == 2
    assert all(t is None for g in ws2[1]["weights"] for _, t in g)  # rank 1 iterates, gets names only
    assert [n for g in ws2[1]["weights"] for n, _ in g] == [n for g in ws2[0]["weights"] for n, _ in g]


def test_save_hf_loads_in_transformers(ws2, paths):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = paths["root"] / "export"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert _max_diff(model.state_dict(), ws2[0]["saved"]) == 0.0
    assert _max_diff(ws2[0]["saved"], ws2[0]["after"]) > 0  # a second step ran before the save
    assert AutoTokenizer.from_pretrained(export).pad_token_id == PAD


def test_critic_values_are_the_value_head_before_each_action(ws2, paths, experience):
    from transformers import AutoModel

    sd = ws2[0]["critic_weights"]
    assert set(sd) >= {"value_head.weight", "model.embed_tokens.weight"} and sd["value_head.weight"].shape == (1, 64)
    backbone = AutoModel.from_pretrained(paths["lm"], dtype=torch.float32).eval()
    batch = experience.as_sequence_batch()
    with torch.no_grad():
        h = backbone(
            input_ids=batch.sequences,
            attention_mask=batch.attention_mask,
            position_ids=_positions(batch.attention_mask),
        ).last_hidden_state  # (B, T, H)
    v = (h @ sd["value_head.weight"].T).squeeze(-1)  # (B, T)
    expected = v[:, -A - 1 : -1] * batch.action_mask
    assert ws2[0]["values"].shape == (B, A) and ws2[1]["values"].shape == (4, A)
    assert (ws2[0]["values"] - expected).abs().max().item() <= 1e-5
    assert (ws2[1]["values"] - expected[:4]).abs().max().item() <= 1e-5
    stats = ws2[0]["critic_stats"]
    assert math.isfinite(stats.loss) and stats.loss > 0 and stats.grad_norm > 0


def test_reward_scores_are_the_last_real_token(ws2, ws1, paths, experience):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(paths["rm"], dtype=torch.float32).eval()
    batch = experience.as_sequence_batch()
    with torch.no_grad():  # HF pools at the last non-pad token; pad id 0 appears only on padding here
        expected = rm(
            input_ids=batch.sequences,
            attention_mask=batch.attention_mask,
            position_ids=_positions(batch.attention_mask),
        ).logits.squeeze(-1)  # (B,)
        per_token = rm.score(
            rm.model(
                input_ids=batch.sequences,
                attention_mask=batch.attention_mask,
                position_ids=_positions(batch.attention_mask),
            ).last_hidden_state
        ).squeeze(-1)
    assert ws2[0]["scores"].shape == (B,) and ws2[1]["scores"].shape == (4,)
    assert (ws2[0]["scores"] - expected).abs().max().item() <= 1e-5
    assert (ws2[1]["scores"] - expected[:4]).abs().max().item() <= 1e-5
    # A critic initialised from the reward model starts as the reward model's per-token score.
    assert (ws1[0]["rm_critic_values"] - per_token[:, -A - 1 : -1] * batch.action_mask).abs().max().item() <= 1e-5


def test_single_pass_without_old_log_probs_makes_the_same_step(ws1, hf_lm):
    # exp's old log-probs are a plain HF forward on the initial weights; without them the actor uses its own
    # detached log-probs: the ratio is 1 either way (up to float rounding), so the optimizer step is the same.
    full, single, after = ws1[0]["stats"], ws1[0]["single_stats"], ws1[0]["after"]
    diffs = torch.cat([(ws1[0]["single_after"][k] - after[k]).abs().flatten() for k in after])
    # Adam's first step is lr * g / (|g| + eps), ~lr * sign(g): an entry whose gradient is ~0 can move by a few %
    # of lr (1e-3) with the float rounding of pi_old (a plain HF forward there, the actor's own forward here).
    # Every other entry agrees to rounding.
    share = (diffs > 1e-6).float().mean().item()
    assert diffs.max().item() <= 5e-5 and share < 1e-3, (diffs.max().item(), share)
    assert _max_diff(ws1[0]["single_after"], dict(hf_lm.state_dict())) > 1e-4  # and the step did move the weights
    assert single.loss == pytest.approx(full.loss, rel=1e-5, abs=1e-6)
    assert single.kl_loss == pytest.approx(full.kl_loss, rel=1e-5, abs=1e-6)
    assert single.clip_frac == 0.0 and single.approx_kl == 0.0  # exactly 1: pi_old is this very forward
    gap = single.extra["engine_gap_sum"] / single.extra["engine_gap_tokens"]
    assert gap == pytest.approx(0.25, abs=1e-4)  # the engines' shift, measured in the training forward
    assert "engine_gap_sum" not in full.extra


def test_zero_stages_agree_and_bf16_checkpointed_step_runs(ws1):
    # ZeRO-3 and ZeRO-0 make the same step, and report the same pre-clip gradient norm.
    assert _max_diff(ws1[0]["stage0_after"], ws1[0]["after"]) <= 1e-5
    assert ws1[0]["stage0_stats"].grad_norm == pytest.approx(ws1[0]["stats"].grad_norm, rel=1e-5)
    assert ws1[0]["stage0_empty"].shape == (0, A)  # an empty share still gives a (0, A) result
    assert ws1[0]["stage0_allreduce"] is False  # one rank: nothing to average, so no gradient all-reduce at all
    stats = ws1[0]["bf16_stage0_stats"]
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert ws1[0]["bf16_stage0_moved"] > 1e-4  # the bf16 weights took the step
    stats = ws1[0]["bf16_stats"]
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert ws1[0]["bf16_attn"] == "orlhf_sdpa_fp32"  # workers/attention.py; its checkpointed step is the one above


def test_bf16_masters_hold_the_checkpoints_fp32_values_not_their_bf16_rounding(ws1, ws2, hf_lm):
    """--bf16 loads the model in bf16; DeepSpeed would make the fp32 masters from that rounding, where updates
    smaller than half a bf16 step never change the weights (workers/fp32_masters.py). Every stage's masters are the
    fp32 checkpoint's values instead; the tiny model's fp32 weights are not bf16 values, so rounding would show."""
    want = {n: p.detach().float() for n, p in hf_lm.named_parameters()}
    assert any(not torch.equal(w.bfloat16().float(), w) for w in want.values())
    for masters in (ws1[0]["bf16_stage0_masters"], ws1[0]["bf16_stage2_masters"], ws2[0]["bf16_zero3_masters"]):
        assert set(masters) == set(want)
        assert all(torch.equal(masters[n], want[n]) for n in want)


def test_adam_offload_train_step_runs(ws1, hf_lm):
    stats = ws1[0]["offload_stats"]
    assert math.isfinite(stats.loss) and stats.grad_norm > 0
    # DeepSpeed's offload layout (host fp32 master and states; on CPU stepped by torch AdamW, workers/optim.py)
    # makes the same first step as the plain engine (up to float rounding).
    assert _max_diff(ws1[0]["offload_after"], ws1[0]["after"]) <= 1e-5


def test_padding_removal_trimmed_padded_and_packed_agree(ws1, ws2, hf_lm, experience):
    expected = _hf_log_probs(hf_lm, experience.as_sequence_batch())
    mask = experience.action_mask
    for name in ("padded", "packed"):
        got = ws1[0][f"{name}_log_probs"]
        assert got.shape == (B, A) and (got - expected)[mask].abs().max().item() <= 1e-5, name
        assert ws1[0][f"{name}_stats"].loss == pytest.approx(ws1[0]["stats"].loss, rel=1e-4, abs=1e-6), name
        # The same optimizer step. AdamW's first step moves a weight by about lr * g / (|g| + eps) (lr 1e-3):
        # where |g| is near eps, the rounding of packed vs padded attention sums shifts that by a few % of lr
        # (1.5e-5 seen on AMD EPYC kernels, under 1e-5 on others); a wrong gradient is off by ~lr.
        assert _max_diff(ws1[0][f"{name}_after"], ws1[0]["after"]) <= 5e-5, name
    rm_values = ws1[0]["rm_critic_values"]
    assert (ws1[0]["packed_rm_critic_values"] - rm_values).abs().max().item() <= 1e-5
    assert math.isfinite(ws1[0]["packed_critic_stats"].loss) and ws1[0]["packed_critic_stats"].grad_norm > 0
    assert (ws1[0]["packed_scores"] - ws2[0]["scores"]).abs().max().item() <= 1e-5


def test_shared_prompt_forwards_score_and_step_as_every_row_run_whole(ws1, ws2, hf_lm, experience):
    grouped = _grouped(experience)
    expected = _hf_log_probs(hf_lm, grouped.as_sequence_batch())
    mask = grouped.action_mask
    out = ws1[0]
    # on by default at ZeRO-2 and ZeRO-3 on one rank, the hosted reference too; off at ZeRO-3 over two ranks
    assert out["shared_flags"] == (True, True) and out["zero3_flags"] == (True, True, True)
    assert out["unshared_flags"] == (False, False) and ws2[0]["shared_prompt"] is False
    for name in ("shared", "shared3", "unshared"):
        assert (out[f"{name}_log_probs"] - expected)[mask].abs().max().item() <= 1e-5, name
    assert (out["ref_grouped"] - expected)[mask].abs().max().item() <= 1e-5
    assert out["shared_stats"].loss == pytest.approx(out["unshared_stats"].loss, rel=1e-5, abs=1e-6)
    assert out["shared_stats"].grad_norm == pytest.approx(out["unshared_stats"].grad_norm, rel=1e-5)
    # the same optimizer step (AdamW's first step: see the padding test for the 5e-5), and in another row order
    assert _max_diff(out["shared_after"], out["unshared_after"]) <= 5e-5
    assert _max_diff(out["shared3_after"], out["unshared_after"]) <= 5e-5  # ZeRO-3 (one rank): two forwards, one step
    assert _max_diff(out["reordered_after"], out["unshared_after"]) <= 5e-5
    assert _max_diff(out["shared_after"], dict(hf_lm.state_dict())) > 1e-4  # and the step moved the weights


def test_shared_prompt_critic_and_reward_model_as_every_row_run_whole(ws1, experience):
    out = ws1[0]
    assert out["critic_shared_flags"] == (True, True) and out["critic_unshared_flags"] == (False, False)
    assert out["rm_shared_flag"] is True and out["rm_unshared_flag"] is False
    assert (out["critic_shared_values"] - out["critic_unshared_values"]).abs().max().item() <= 1e-5
    assert out["critic_shared_values"].abs().max().item() > 1e-3  # values, not zeros
    assert (out["rm_shared_scores"] - out["rm_unshared_scores"]).abs().max().item() <= 1e-5
    # the scores are those of whole sequences (test_reward_scores_are_the_last_real_token checks the unshared ones)
    assert out["rm_shared_scores"].shape == (B,) and out["rm_shared_scores"].std().item() > 1e-4
    assert out["critic_shared_stats"].loss == pytest.approx(out["critic_unshared_stats"].loss, rel=1e-5, abs=1e-7)
    assert _max_diff(out["critic_shared_after"], out["critic_unshared_after"]) <= 5e-5


def test_report_costs(ws2, ws1):
    """Not an assertion of speed: prints what the tiny model costs, for the record (-s to see it)."""
    for r, out in enumerate(ws2):
        print(f"ws2 rank {r}: " + ", ".join(f"{k}={v:.2f}" for k, v in out.items() if k.startswith(("time/", "rss"))))
    print("ws1: " + ", ".join(f"{k}={v:.2f}" for k, v in ws1[0].items() if k.startswith("time/")))
