"""The delta weight sync's codec (--vllm_sync_delta): what changed since the last sync, as indices and values.

Both ends hold the same copy of what the engines hold, in the engines' dtype: the sender (actor rank 0,
workers/weight_send.py) the last-sent cast of each tensor, every engine worker (rollout/worker_ext.py) what it last
loaded. Per bucket of tensors (the sync's buckets, whole layers each) the sender broadcasts

    codes    int64 (n,)        per tensor its form: k >= 0 changed elements as indices, MASK - k (<= -2) the same
                               as a bitmask, DENSE (-1) the whole tensor
    indices  int32 (sum k,)    flat positions of the changed elements of the index-form tensors, tensor by tensor
    masks    uint8             one bit per element (little-endian within a byte) of the mask-form tensors
    values   engine dtype      per tensor in the bucket's order: its changed elements' new values, or all of it

(each only when non-empty: both ends know the sizes from the codes). Per tensor the smallest form for v bytes per
element, n elements, k changed: indices k(4 + v), bitmask n/8 + kv, whole nv. Whole also when the receiver holds no
copy yet (a full sync: the first, and the first after an engine was replaced or a sync failed).

Exact by construction: "changed" compares bit patterns (so -0.0 vs 0.0 and NaNs count as changes), the new values
are the same cast a full sync's receiver makes (`t.to(engine dtype)`, round to nearest even on every device), and
the receiver writes them into its held copy, so after every sync both copies equal that cast bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

DENSE, MASK = -1, -2
_BITS = {2: torch.int16, 4: torch.int32, 1: torch.int8, 8: torch.int64}
_MAX_INDEX = 2**31 - 1
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def changed_mask(new: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Flat bool: where new and held (same dtype and shape) differ bit for bit."""
    if new.dtype != held.dtype or new.shape != held.shape:
        raise ValueError(f"delta of {new.dtype}{tuple(new.shape)} against a held {held.dtype}{tuple(held.shape)}")
    bits = _BITS[new.element_size()]
    return new.reshape(-1).view(bits) != held.reshape(-1).view(bits)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Flat bool (n,) -> uint8 (ceil(n / 8),), element i in bit i % 8 of byte i // 8.

    Eight bools are eight 0/1 bytes of one little-endian int64; the multiply moves byte i's bit to bit 56 + i (no two
    products meet there, and nothing below carries into it), so the top byte is the packed one."""
    pad = (-mask.numel()) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask.contiguous()
    words = m.view(torch.uint8).view(torch.int64)
    return ((words * 0x0102040810204080) >> 56 & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return ((packed[:, None] >> _SHIFTS) & 1).reshape(-1)[:n].bool()


def encode(new: torch.Tensor, held: Optional[torch.Tensor]) -> tuple[int, Optional[torch.Tensor], torch.Tensor]:
    """(code, int32 indices | uint8 bitmask | None, values) for one tensor already cast to the engine dtype: the
    smallest of the three forms; whole (DENSE) when held is None (nothing to diff against)."""
    flat = new.reshape(-1)
    n, v = flat.numel(), flat.element_size()
    if held is None:
        return DENSE, None, flat
    changed = changed_mask(new, held)
    k = int(torch.count_nonzero(changed))  # bool .sum() converts to int64 first: 30x slower on CPU
    sizes = {"idx": k * (4 + v) if n <= _MAX_INDEX else n * v + 1, "mask": (n + 7) // 8 + k * v, "dense": n * v}
    form = min(sizes, key=sizes.get)
    if form == "dense":
        return DENSE, None, flat
    if form == "mask":
        return MASK - k, pack_bits(changed), flat[changed]
    idx = torch.nonzero(changed).reshape(-1)
    return k, idx.to(torch.int32), flat[idx]


def encode_bucket(news: list[torch.Tensor], helds: list[Optional[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """(codes, indices, masks, values) of a bucket: the four tensors the sender broadcasts (empty ones are not)."""
    codes, parts = [], {torch.int32: [], torch.uint8: [], "values": []}
    for new, held in zip(news, helds):
        code, aux, vals = encode(new, held)
        codes.append(code)
        if aux is not None:
            parts[aux.dtype].append(aux)
        parts["values"].append(vals)
    dtype = news[0].dtype if news else torch.float32
    out = [torch.tensor(codes, dtype=torch.int64)]
    for key, empty in ((torch.int32, torch.int32), (torch.uint8, torch.uint8), ("values", dtype)):
        out.append(torch.cat(parts[key]) if parts[key] else torch.empty(0, dtype=empty))
    return tuple(out)


def bucket_sizes(codes: list[int], numels: list[int]) -> tuple[int, int, int]:
    """(indices, mask bytes, values) element counts a bucket's codes announce: what the receiver allocates."""
    idx = sum(c for c in codes if c >= 0)
    masks = sum((n + 7) // 8 for c, n in zip(codes, numels) if c <= MASK)
    values = sum(n if c == DENSE else c if c >= 0 else MASK - c for c, n in zip(codes, numels))
    return idx, masks, values


def apply_bucket(
    helds: list[Optional[torch.Tensor]],
    shapes: list[tuple],
    codes: list[int],
    indices: torch.Tensor,
    masks: torch.Tensor,
    values: torch.Tensor,
) -> list[torch.Tensor]:
    """The receiver's side of encode_bucket: the bucket's tensors after this sync, written into `helds` in place
    where partial (a whole tensor is a new one, a view of `values`). Raises on a partial update of a tensor not
    held: a full sync must come first (the sender and this receiver disagree on what the engine holds)."""
    out, at = [], {"idx": 0, "mask": 0, "val": 0}
    for held, shape, code in zip(helds, shapes, codes):
        n = 1
        for s in shape:
            n *= s
        k = n if code == DENSE else code if code >= 0 else MASK - code
        vals = values[at["val"] : at["val"] + k]
        at["val"] += k
        if code == DENSE:
            out.append(vals.view(tuple(shape)))
            continue
        if held is None:
            raise RuntimeError(
                "a delta for a tensor this engine does not hold: the sync after a start or a replacement must be "
                "a full one"
            )
        if code >= 0:
            where = indices[at["idx"] : at["idx"] + k].long()
            at["idx"] += k
        else:
            where = unpack_bits(masks[at["mask"] : at["mask"] + (n + 7) // 8], n)
            at["mask"] += (n + 7) // 8
        if k:
            held.view(-1)[where] = vals
        out.append(held)
    return out
