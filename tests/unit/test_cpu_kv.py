"""The CPU engines' KV cache size (orlhf/cpu/engine_kv.py): automatic, user-given, refused."""

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
    # 88 tokens -> one 128-token block per sequence, plus vLLM's null block
    assert kv_cache_bytes(path, "float32", 88, None) == (MAX_NUM_SEQS + 1) * BLOCK_TOKENS * per_token
    assert kv_cache_bytes(path, "float32", 129, None) == (2 * MAX_NUM_SEQS + 1) * BLOCK_TOKENS * per_token
    assert kv_cache_bytes(path, "float32", 32768, None) == GIB  # more than the 1 GiB cap: stays at it


def test_user_given_size_is_honoured_or_refused_naming_the_flag(tmp_path):
    path = model(tmp_path)
    assert kv_cache_bytes(path, "float32", 88, 0.25) == GIB // 4
    assert kv_cache_bytes(path, "float32", 88, 3.0) == 3 * GIB  # larger than the automatic size: as given
    with pytest.raises(ValueError, match="--vllm_cpu_kv_cache_gb 1e-05 cannot hold one sequence of 88 tokens"):
        kv_cache_bytes(path, "float32", 88, 1e-5)


def test_unreadable_config_gets_the_fallback_size(tmp_path):
    assert kv_cache_bytes(str(tmp_path), "float32", 88, None) == GIB
    assert kv_cache_bytes(str(tmp_path), "float32", 88, 1e-5) == int(1e-5 * GIB)  # nothing to check it against
