"""The delta weight sync's codec (--vllm_sync_delta): what changed since the last sync, as indices and values.

Both ends hold the same copy of what the engines hold, in the engines' dtype: the sender (actor rank 0,
workers/weight_send.py) the last-sent cast of each tensor, every engine worker (rollout/worker_ext.py) what it last
loaded. Per bucket of tensors (the sync's buckets, whole layers each) the sender broadcasts

    counts   int64 (n,)       per tensor: the changed elements k, or DENSE (-1) for the whole tensor
    indices  int32 (sum k,)   flat positions of the changed elements of the sparse tensors, tensor after tensor
    values   engine dtype     their new values, then each dense tensor whole, in the bucket's order

(indices and values only when non-empty: both ends know the sizes from counts). A tensor goes dense where that is
smaller (k * (4 + v) >= n * v for v bytes per element), when the receiver holds no copy yet (a full sync: the first,
and the first after an engine was replaced or a sync failed), or when it has 2^31 elements or more (int32 indices).

Exact by construction: "changed" compares bit patterns (so -0.0 vs 0.0 and NaNs count as changes), the new values
are the same cast a full sync's receiver makes (`t.to(engine dtype)`, round to nearest even on every device), and
the receiver writes them into its held copy, so after every sync both copies equal that cast bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

DENSE = -1
_BITS = {2: torch.int16, 4: torch.int32, 1: torch.int8, 8: torch.int64}
_MAX_INDEX = 2**31 - 1


def changed_indices(new: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions where new and held (same dtype and shape) differ bit for bit."""
    if new.dtype != held.dtype or new.shape != held.shape:
        raise ValueError(f"delta of {new.dtype}{tuple(new.shape)} against a held {held.dtype}{tuple(held.shape)}")
    bits = _BITS[new.element_size()]
    return torch.nonzero(new.reshape(-1).view(bits) != held.reshape(-1).view(bits)).reshape(-1)


def encode(new: torch.Tensor, held: Optional[torch.Tensor]) -> tuple[int, Optional[torch.Tensor], torch.Tensor]:
    """(count, int32 indices or None, values) for one tensor already cast to the engine dtype; DENSE when the
    whole tensor is smaller, too large for int32 indices, or held is None (nothing to diff against)."""
    flat = new.reshape(-1)
    n, v = flat.numel(), flat.element_size()
    if held is None or n > _MAX_INDEX:
        return DENSE, None, flat
    idx = changed_indices(new, held)
    k = idx.numel()
    if k * (4 + v) >= n * v:
        return DENSE, None, flat
    return k, idx.to(torch.int32), flat[idx]


def encode_bucket(
    news: list[torch.Tensor], helds: list[Optional[torch.Tensor]]
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(counts, indices or None, values or None) of a bucket: the three tensors the sender broadcasts."""
    counts, idx, sparse_vals, dense_vals = [], [], [], []
    for new, held in zip(news, helds):
        k, i, vals = encode(new, held)
        counts.append(k)
        if k == DENSE:
            dense_vals.append(vals)
        else:
            idx.append(i)
            sparse_vals.append(vals)
    device = news[0].device if news else torch.device("cpu")
    indices = torch.cat(idx) if idx and sum(t.numel() for t in idx) else None
    vals = [v for v in sparse_vals + dense_vals if v.numel()]
    values = torch.cat(vals) if vals else None
    return torch.tensor(counts, dtype=torch.int64, device=device), indices, values


def bucket_sizes(counts: list[int], numels: list[int]) -> tuple[int, int]:
    """(indices, values) element counts a bucket's counts announce: what the receiver allocates."""
    k = sum(c for c in counts if c != DENSE)
    return k, k + sum(n for c, n in zip(counts, numels) if c == DENSE)


def apply_bucket(
    helds: list[Optional[torch.Tensor]],
    shapes: list[tuple],
    counts: list[int],
    indices: Optional[torch.Tensor],
    values: Optional[torch.Tensor],
) -> list[torch.Tensor]:
    """The receiver's side of encode_bucket: the bucket's tensors after this sync, written into `helds` in place
    where sparse (a dense tensor is a new one, a view of `values`). Raises on a sparse delta against no held copy:
    a full sync must come first (the sender and this receiver disagree on what the engine holds)."""
    out, i_pos, sparse_v = [], 0, 0
    dense_v = sum(c for c in counts if c != DENSE)  # dense values follow the sparse ones
    for held, shape, k in zip(helds, shapes, counts):
        if k == DENSE:
            n = 1
            for s in shape:
                n *= s
            out.append(values[dense_v : dense_v + n].view(tuple(shape)))
            dense_v += n
            continue
        if held is None:
            raise RuntimeError(
                "a delta for a tensor this engine does not hold: the sync after a start or a "
                "replacement must be a full one"
            )
        if k:
            held.view(-1)[indices[i_pos : i_pos + k].long()] = values[sparse_v : sparse_v + k]
        i_pos, sparse_v = i_pos + k, sparse_v + k
        out.append(held)
    return out
