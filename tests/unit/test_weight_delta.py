"""The delta sync's codec (workers/weight_delta.py) and its flag: a bucket encoded against the held copy and applied
on the other side leaves that side's copy equal, bit for bit, to the new cast; the flag's refusals. The sync over
real engines: tests/vllm/test_delta_sync.py."""

import pytest
import torch

from orlhf.config.flags import build_config
from orlhf.config.train_config import ConfigError
from orlhf.workers.weight_delta import (
    DENSE,
    MASK,
    apply_bucket,
    bucket_sizes,
    changed_mask,
    encode,
    encode_bucket,
    pack_bits,
    unpack_bits,
)


def roundtrip(news, sender_held, receiver_held):
    """Encode on the sender's side, apply on a receiver holding receiver_held: the tensors it would load."""
    codes, *parts = encode_bucket(news, sender_held)
    codes = codes.tolist()
    sizes = bucket_sizes(codes, [t.numel() for t in news])
    assert [p.numel() for p in parts] == list(sizes)  # what the receiver allocates is what was sent
    return codes, apply_bucket(receiver_held, [tuple(t.shape) for t in news], codes, *parts)


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
    if dtype == torch.bfloat16:  # few bf16 values move at this step size: not whole
        assert all(c != DENSE for c in counts)


def test_each_tensor_takes_its_smallest_form():
    """n = 1000 fp32 (4000 bytes whole): k changed as indices k x 8, as a bitmask 125 + 4k."""
    new = torch.arange(1000, dtype=torch.float32)
    assert encode(new, None)[0] == DENSE  # a full sync
    assert encode(new, new + 1)[0] == DENSE  # all changed: 4000 < 4125
    held = new.clone()
    held[[6, 900]] = -1.0
    code, idx, vals = encode(new, held)  # 16 bytes as indices
    assert (code, idx.tolist(), vals.tolist()) == (2, [6, 900], [6.0, 900.0])
    held[:300] = -1.0
    code, mask, vals = encode(new, held)  # 300 changed: 2400 as indices, 1325 as a bitmask
    assert code == MASK - 301 and mask.dtype == torch.uint8 and mask.numel() == 125
    assert unpack_bits(mask, 1000).nonzero().reshape(-1).tolist() == list(range(300)) + [900]
    assert encode(new, new.clone())[0] == 0  # unchanged: nothing but its code


def test_bits_pack_and_unpack():
    m = torch.rand(1001, generator=torch.Generator().manual_seed(0)) < 0.3
    assert pack_bits(m).numel() == 126 and torch.equal(unpack_bits(pack_bits(m), 1001), m)
    assert pack_bits(torch.tensor([True, False, True])).tolist() == [0b101]


def test_bit_patterns_not_values_decide():
    held = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    assert changed_mask(new, held).tolist() == [True, False, False]  # -0.0 != 0.0 in bits; equal NaNs are equal
    with pytest.raises(ValueError, match="delta of"):
        changed_mask(new, held.float())


def test_a_mixed_bucket_and_a_full_one():
    g = torch.Generator().manual_seed(1)
    news = [torch.randn(1000, generator=g).bfloat16() for _ in range(4)]
    held = [news[0].clone(), torch.zeros(1000, dtype=torch.bfloat16), news[2].clone(), news[3].clone()]
    held[0][[3, 7]] = 0
    held[3][::5] = 0  # 200 of 1000: a bitmask (525 bytes) beats indices (1200)
    receiver = [h.clone() for h in held]
    codes, out = roundtrip(news, held, receiver)
    assert codes == [2, DENSE, 0, MASK - 200]
    assert all(same_bits(o, n) for o, n in zip(out, news))
    fresh = [None] * 4  # a replaced engine: a full sync loads everything whole
    codes, out = roundtrip(news, fresh, fresh)
    assert codes == [DENSE] * 4 and all(same_bits(o, n) for o, n in zip(out, news))


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
