"""`orlhf plan` on cpu: each process's parts (launch/plan_cpu.py), by hand on SmolLM2-135M's shapes. No Ray here."""

import pytest

from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.distributed.layout import described_nodes, simulate
from orlhf.launch import plan_cpu
from orlhf.launch.bringup import run_layout
from orlhf.launch.plan_memory import GIB, ModelDims, count_params, role_memory

# SmolLM2-135M-Instruct (the real-model recipe's): h 576, 30 layers, I 1536, vocab 49152, 9 heads x 64, 3 KV heads.
SMOL = ModelDims("smol", 576, 30, 1536, 49152, 9, 3, 64, True, 4)
# The recipe's shape: 8 samples a micro-batch, 128 + 24 tokens.
RECIPE = dict(micro_train_batch_size=8, prompt_max_len=128, generate_max_len=24, init_kl_coef=0.0)


def cfg_of(**flags):
    return resolve_device(build_config(flags, explicit=set(flags)), "cpu")


def test_saved_activations_per_token_and_layer():
    # 4h + 3q + 2kv + 4I = 2,304 + 1,728 + 384 + 6,144 (q = 9 x 64 = 576 = h, kv = 3 x 64 = 192)
    assert plan_cpu.saved_per_token_layer(SMOL) == 10_560


def test_actor_pass_is_activations_plus_logits_of_the_response():
    size, text = plan_cpu.train_pass(cfg_of(**RECIPE), "actor", SMOL)
    # activations: 8 x 152 tokens x 30 layers x 10,560 x 4 B = 1,540,915,200 B;
    # logits: 4 copies x 8 x 24 rows x 49,152 x 4 B = 4 x 37,748,736 = 150,994,944 B
    assert size == 1_540_915_200 + 150_994_944
    assert "8 seq x 152 tok x 30 layers" in text and "logits 8 x 24 x 49152" in text


def test_chunked_logits_cost_one_chunk_and_a_value_head_none():
    cfg = cfg_of(**RECIPE, logprobs_chunk_mb=16)  # 37,748,736 B of logits > 16 MiB: one chunk, 16,777,216 B
    assert plan_cpu.train_pass(cfg, "actor", SMOL)[0] == 1_540_915_200 + 4 * 16_777_216
    assert plan_cpu.train_pass(cfg, "critic", SMOL)[0] == 1_540_915_200  # critic: value head, no vocabulary
    assert plan_cpu.logits_bytes(10, 100, 0) == 4_000  # --logprobs_chunk_mb 0: the whole logits


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layer():
    cfg = cfg_of(**RECIPE, gradient_checkpointing=True)
    # 8 x 152 tokens x (30 layers x 576 + 10,560) x 4 B = 1,216 x 27,840 x 4 = 135,413,760 B
    assert plan_cpu.train_pass(cfg, "critic", SMOL)[0] == 135_413_760


def test_bf16_halves_the_activations():
    assert plan_cpu.train_pass(cfg_of(**RECIPE, bf16=True), "critic", SMOL)[0] == 1_540_915_200 // 2


def test_engine_holds_weights_the_heads_packed_copy_and_its_kv_cache():
    parts = dict(plan_cpu.engine_process(cfg_of(**RECIPE), SMOL).parts)
    assert parts["weights 4P"] == 4 * count_params(SMOL) / GIB
    assert parts["LM head's packed copy"] == 4 * 49152 * 576 / GIB  # 113,246,208 B
    # K + V: 30 layers x 2 x 3 x 64 x 4 B = 46,080 B a token; 256 seqs x 5 blocks of 32 (152 tokens) + 1 block
    # = 1,281 x 32 x 46,080 = 1,888,911,360 B > the 1 GiB bound: 1 GiB
    assert parts["KV cache"] == 1.0
    demo = ModelDims("demo", 128, 2, 256, 1024, 4, 4, 32, False, 4)  # 2 x 2 x 4 x 32 x 4 B = 2,048 B a token
    short = dict(plan_cpu.engine_process(cfg_of(prompt_max_len=64, generate_max_len=24), demo).parts)
    assert short["KV cache"] == 769 * 32 * 2_048 / GIB  # 88 tokens: three blocks of 32 each, + 1: 50,397,184 B
    given = dict(plan_cpu.engine_process(cfg_of(**RECIPE, vllm_cpu_kv_cache_gb=0.5), SMOL).parts)
    assert given["KV cache"] == 0.5


def test_fp32_zero2_counts_deepspeeds_master_copy():
    # ZeRO-1/2 clone an fp32 master partition even of fp32 weights: 4 + 4 + (4 + 8) = 20 B a parameter on 1 rank
    assert role_memory(cfg_of(zero_stage=2), "actor", GIB, 1, device="cpu").device_gib == 20
    assert role_memory(cfg_of(zero_stage=0), "actor", GIB, 1, device="cpu").device_gib == 16  # no master copy


def test_guests_join_their_hosts_process_and_hosts_add_ray_and_the_driver():
    cfg = cfg_of()  # the demo's GAE: actor + hosted ref + critic in one process, one engine
    layout = run_layout(cfg)
    dims = {r: SMOL for r in layout.roles}
    mems = {r: role_memory(cfg, r, GIB // 16, 1, device="cpu") for r in layout.roles}
    procs = plan_cpu.processes(cfg, layout, mems, dims, None)
    rank, engine = procs[0][0], procs[1][0]
    assert len(procs) == 2 and rank.who == "actor + ref + critic rank" and engine.who == "vllm engine"
    names = [n for n, _ in rank.parts]
    assert names[:4] == ["base", "actor states", "ref states", "critic states"]  # one ZeRO-2 rank: no bucket
    assert names[4].startswith("actor activations")  # the larger pass: the actor's logits on top of the same layers
    nodes = described_nodes(2, 4, "cpu")
    placed, _ = simulate(layout, nodes)
    need = plan_cpu.host_needs(procs, nodes, placed)
    ray, driver = plan_cpu.RAY_BASE / GIB, plan_cpu.DRIVER_BASE / GIB
    assert sum(need) == pytest.approx(rank.gib + engine.gib + 2 * ray + driver)


def test_gradient_bucket_is_the_part_the_gradients_touch():
    cfg, p_smol = cfg_of(**RECIPE), count_params(SMOL)
    mem = role_memory(cfg, "actor", p_smol, 1, device="cpu")
    assert plan_cpu.touched_bucket(cfg, "actor", mem, SMOL) == 0  # one ZeRO-2 rank: no contiguous gradients
    mem = role_memory(cfg, "actor", p_smol, 2, device="cpu")
    two = cfg_of(**RECIPE, zero_stage=2)
    assert plan_cpu.touched_bucket(two, "actor", mem, SMOL) == 4 * p_smol  # 2 ranks, fp32: all 134.5M gradients
    big = role_memory(cfg_of(bf16=True, zero_stage=1), "actor", 10**9, 4, device="cpu")
    assert plan_cpu.touched_bucket(cfg_of(bf16=True, zero_stage=1), "actor", big, SMOL) == 5e8 * 4  # full, fp32
    # LoRA (all-linear by default): only the adapter's gradients, 30 layers x rank 8 x (in + out) summed over
    # q 1152, k 768, v 768, o 1152, gate 2112, up 2112, down 2112 = 10,176 -> 2,442,240 parameters
    lora = cfg_of(**RECIPE, lora_rank=8, zero_stage=2)
    assert plan_cpu.touched_bucket(lora, "actor", mem, SMOL) == 4 * 2_442_240
    assert plan_cpu.touched_bucket(cfg_of(**RECIPE, zero_stage=0), "actor", mem, SMOL) == 0  # no ZeRO, no bucket
