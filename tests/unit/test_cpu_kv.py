"""The CPU engines' KV cache size (orlhf/cpu/engine_kv.py): automatic, user-given, refused."""

import dataclasses
import json

import pytest

from orlhf.cpu.engine_kv import BLOCK_TOKENS, MAX_NUM_SEQS, kv_bytes_per_token, kv_cache_bytes

GIB = 2**30


def model(tmp_path, **over):
    cfg = {
        "model_type": "llama",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "sliding_window": None,
    }
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_bytes_per_token_from_the_config(tmp_path):
    # 3 layers x (K, V) x 2 KV heads x head dim 128/4 x 4 bytes
    assert kv_bytes_per_token(model(tmp_path), "float32") == 3 * 2 * 2 * 32 * 4
    assert kv_bytes_per_token(model(tmp_path, head_dim=64), "bfloat16") == 3 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(model(tmp_path, layer_types=["full_attention"] * 3), "float32") == 3 * 2 * 2 * 32 * 4


@pytest.mark.parametrize(
    "over",
    [
        {"kv_lora_rank": 512},
        {"sliding_window": 4096},
        {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
        {"text_config": {"hidden_size": 64}},
    ],
)
def test_other_attention_gets_the_fallback_size(tmp_path, over):
    path = model(tmp_path, **over)
    assert kv_bytes_per_token(path, "float32") is None
    assert kv_cache_bytes(path, "float32", 88, None) == GIB


def test_automatic_size_holds_every_sequence_vllm_may_run(tmp_path):
    path = model(tmp_path)
    per_token = 3 * 2 * 2 * 32 * 4
    # 64 tokens -> two 32-token blocks per sequence, 65 -> three, plus vLLM's null block
    assert BLOCK_TOKENS == 32
    assert kv_cache_bytes(path, "float32", 64, None) == (2 * MAX_NUM_SEQS + 1) * BLOCK_TOKENS * per_token
    assert kv_cache_bytes(path, "float32", 65, None) == (3 * MAX_NUM_SEQS + 1) * BLOCK_TOKENS * per_token
    assert kv_cache_bytes(path, "float32", 32768, None) == GIB  # more than the 1 GiB cap: stays at it


def test_plain_attention_engines_get_small_blocks_and_share_prompts(tmp_path):
    from orlhf.cpu.engine_kv import block_args
    from orlhf.rollout.engine_config import EngineConfig

    cfg = EngineConfig(model_path=model(tmp_path), device="cpu", share_prompts=True)
    assert block_args(cfg) == {"block_size": BLOCK_TOKENS, "enable_prefix_caching": True}
    # R3 router replay records the experts of computed tokens: no sharing (as --enable_prefix_caching gives)
    assert block_args(dataclasses.replace(cfg, share_prompts=False)) == {"block_size": BLOCK_TOKENS}
    (tmp_path / "mla").mkdir()
    other = EngineConfig(model_path=model(tmp_path / "mla", kv_lora_rank=64), device="cpu", share_prompts=True)
    assert block_args(other) == {}  # vLLM's own block size and prefix caching for other attention


def test_run_config_shares_prompts_on_cpu_except_under_r3():
    from orlhf.config.resolve import finish_config
    from orlhf.rollout.engine_config import engine_config

    def shares(**flags):
        return engine_config(finish_config(flags, frozenset(flags))).share_prompts

    assert shares(device="cpu") and not shares(device="cuda")
    assert not shares(device="cpu", router_replay="R3")


def test_user_given_size_is_honoured_or_refused_naming_the_flag(tmp_path):
    path = model(tmp_path)
    assert kv_cache_bytes(path, "float32", 88, 0.25) == GIB // 4
    assert kv_cache_bytes(path, "float32", 88, 3.0) == 3 * GIB  # larger than the automatic size: as given
    with pytest.raises(ValueError, match="--vllm_cpu_kv_cache_gb 1e-05 cannot hold one sequence of 88 tokens"):
        kv_cache_bytes(path, "float32", 88, 1e-5)


def test_unreadable_config_gets_the_fallback_size(tmp_path):
    assert kv_cache_bytes(str(tmp_path), "float32", 88, None) == GIB
    assert kv_cache_bytes(str(tmp_path), "float32", 88, 1e-5) == int(1e-5 * GIB)  # nothing to check it against
