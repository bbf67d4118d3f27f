"""The delta sync's codec (workers/weight_delta.py) and its flag: a bucket encoded against the held copy and applied
on the other side leaves that side's copy equal, bit for bit, to the new cast; the flag's refusals. The sync over
real engines: tests/vllm/test_delta_sync.py."""

import pytest
import torch

from orlhf.config.flags import build_config
from orlhf.config.train_config import ConfigError
from orlhf.workers.weight_delta import DENSE, apply_bucket, bucket_sizes, changed_indices, encode, encode_bucket


def roundtrip(news, sender_held, receiver_held):
    """Encode on the sender's side, apply on a receiver holding receiver_held: the tensors it would load."""
    counts, indices, values = encode_bucket(news, sender_held)
    counts = counts.tolist()
    k, nv = bucket_sizes(counts, [t.numel() for t in news])
    assert (indices.numel() if indices is not None else 0) == k
    assert (values.numel() if values is not None else 0) == nv
    idx = indices if indices is not None else torch.empty(0, dtype=torch.int32)
    vals = values if values is not None else torch.empty(0, dtype=news[0].dtype)
    return counts, apply_bucket(receiver_held, [tuple(t.shape) for t in news], counts, idx, vals)


def same_bits(a, b):
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_small_update_round_trips_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    master = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g), torch.randn(8, 8, 4, generator=g)]
    held = [m.to(dtype) for m in master]
    receiver = [h.clone() for h in held]
    # an Adam-sized step in fp32: in bf16 only the elements that cross a rounding step move
    master = [m + 1e-4 * torch.randn(m.shape, generator=g) for m in master]
    news = [m.to(dtype) for m in master]
    counts, out = roundtrip(news, held, receiver)
    assert all(same_bits(o, n) for o, n in zip(out, news))
    # sparse tensors were applied to the receiver's copy in place; a dense one replaces it
    assert all(same_bits(r, n) for r, n, c in zip(receiver, news, counts) if c != DENSE)
    if dtype == torch.bfloat16:  # few bf16 values move at this step size: indices + values, not dense
        assert all(c != DENSE for c in counts)
        assert sum(counts) < 0.2 * sum(n.numel() for n in news)


def test_dense_where_smaller_and_where_nothing_is_held():
    new = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert encode(new, None)[0] == DENSE  # a full sync
    assert encode(new, torch.zeros(3, 4))[0] == DENSE  # 11 of 12 changed: indices + values would be larger
    held = new.clone()
    held[1, 2] = -1.0
    k, idx, vals = encode(new, held)
    assert (k, idx.tolist(), vals.tolist()) == (1, [6], [6.0])
    assert encode(new, new.clone())[0] == 0  # unchanged: nothing but its count


def test_bit_patterns_not_values_decide():
    held = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    assert changed_indices(new, held).tolist() == [0]  # -0.0 differs from 0.0 in its bits; equal NaNs do not
    with pytest.raises(ValueError, match="delta of"):
        changed_indices(new, held.float())


def test_a_mixed_bucket_and_a_full_one():
    g = torch.Generator().manual_seed(1)
    news = [torch.randn(100, generator=g).bfloat16() for _ in range(3)]
    held = [news[0].clone(), torch.zeros(100, dtype=torch.bfloat16), news[2].clone()]
    held[0][[3, 7]] = 0
    receiver = [h.clone() for h in held]
    counts, out = roundtrip(news, held, receiver)
    assert counts == [2, DENSE, 0]
    assert all(same_bits(o, n) for o, n in zip(out, news))
    fresh = [None, None, None]  # a replaced engine: a full sync loads everything dense
    counts, out = roundtrip(news, fresh, fresh)
    assert counts == [DENSE] * 3 and all(same_bits(o, n) for o, n in zip(out, news))


def test_a_delta_to_a_receiver_holding_nothing_is_refused():
    news = [torch.ones(100, dtype=torch.bfloat16)]
    held = [news[0].clone()]
    held[0][5] = 0
    with pytest.raises(RuntimeError, match="must be a full one"):
        roundtrip(news, held, [None])


def test_the_flag():
    assert not build_config({}, explicit=set()).vllm.sync_delta
    assert build_config({"vllm_sync_delta": True}, explicit={"vllm_sync_delta"}).vllm.sync_delta
    flags = {"vllm_sync_delta": True, "device": "cuda", "colocate_all_models": True}
    with pytest.raises(ConfigError) as err:
        build_config(flags, explicit=set(flags))
    assert any("--vllm_sync_delta" in p and "CUDA IPC" in p for p in err.value.problems)
    flags = {"vllm_sync_delta": True, "vllm_num_engines": 0}
    with pytest.raises(ConfigError) as err:
        build_config(flags, explicit=set(flags))
    assert any("--vllm_sync_delta" in p for p in err.value.problems)


def test_the_plan_counts_the_held_copies():
    """`orlhf plan`: eP (engine dtype bytes x params) in host memory on actor rank 0 and in each engine worker."""
    from orlhf.launch.plan_memory import GIB, delta_copy_bytes, role_memory

    on = build_config({"vllm_sync_delta": True}, explicit={"vllm_sync_delta"})
    bf16 = build_config({"vllm_sync_delta": True, "bf16": True}, explicit={"vllm_sync_delta", "bf16"})
    off = build_config({}, explicit=set())
    assert delta_copy_bytes(off, 1000, "cpu") == 0
    assert delta_copy_bytes(on, 1000, "cpu") == 4000  # fp32 engines on CPU
    assert delta_copy_bytes(on, 1000, "cuda") == delta_copy_bytes(bf16, 1000, "cpu") == 2000  # bf16 engines
    with_copy, without = (role_memory(c, "actor", 10**9, 2, device="cuda") for c in (on, off))
    assert with_copy.host_gib - without.host_gib == pytest.approx(2e9 / GIB)
    assert with_copy.device_gib == without.device_gib and "held copy" in with_copy.formula
