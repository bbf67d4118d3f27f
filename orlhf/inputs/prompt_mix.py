"""Several prompt sources, as OpenRLHF's blending_datasets takes them: --prompt_data a,b [--prompt_data_probs].

    --prompt_data "a,b" --split_sources--> [a, b] --prompts.load_prompt_rows (each, --prompt_split, --max_samples)
        no --prompt_data_probs:   a's rows then b's rows (concatenated)
        --prompt_data_probs p,q:  rows drawn source by source (interleave_order), until every source was used up
    --> at most --max_samples rows in all --> prompts.build_prompts

One source without --prompt_data_probs reads exactly as prompts.load_prompt_rows does. The mix depends only on
(the sources' lengths, the probabilities, --seed), so a resumed run rebuilds the same list.
"""

from __future__ import annotations

import logging

from orlhf.inputs.errors import DataError
from orlhf.inputs.prompts import PromptRows, load_prompt_rows

logger = logging.getLogger(__name__)


def split_sources(prompt_data: str) -> list[str]:
    """--prompt_data "a, b" -> ["a", "b"]; an empty entry (a,,b or a trailing comma) is a DataError."""
    sources = [s.strip() for s in prompt_data.split(",")]
    if not all(sources):
        raise DataError(
            f"--prompt_data {prompt_data!r}: an empty entry in the comma-separated list; write a,b with no empty parts."
        )
    return sources


def parse_probs(probs: str, sources: list[str]) -> list[float]:
    """--prompt_data_probs "0.7,0.3" -> [0.7, 0.3]: one finite value > 0 per source, summing to 1 (within 1e-6)."""
    parts = [p.strip() for p in probs.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DataError(
            f"--prompt_data_probs {probs}: {[p for p in parts if not _is_float(p)]} not numbers; "
            "write one probability per --prompt_data source, e.g. 0.7,0.3."
        ) from None
    if len(values) != len(sources):
        raise DataError(
            f"--prompt_data_probs {probs}: {len(values)} values for {len(sources)} --prompt_data "
            f"sources ({', '.join(sources)}); give one probability per source."
        )
    if not all(v > 0 and v < float("inf") for v in values):
        # A 0 would make the "all_exhausted" mix wait forever for that source to be used up (OpenRLHF hangs).
        raise DataError(
            f"--prompt_data_probs {probs}: every probability must be > 0 and finite; to leave a "
            "source out, drop it from --prompt_data."
        )
    total = sum(values)
    if abs(total - 1.0) > 1e-6:
        scaled = ",".join(f"{v / total:.4g}" for v in values)
        raise DataError(
            f"--prompt_data_probs {probs}: the probabilities sum to {total:.6g}, not 1; e.g. "
            f"--prompt_data_probs {scaled}."
        )
    return values


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def interleave_order(
    lengths: list[int], probs: list[float], seed: int, limit: int | None = None
) -> list[tuple[int, int]]:
    """(source, row) picks of a probability mix, as datasets.interleave_datasets(probabilities, seed,
    stopping_strategy="all_exhausted") orders them (OpenRLHF's blending_datasets):

        draw a source with numpy's default_rng(seed).choice(n, p=probs), 1000 draws at a time;
        take that source's next row, cycling back to its first row once it ran out;
        stop as soon as every source has run out at least once (before the next pick).

    So the mix holds about max_i(len_i / p_i) rows and repeats the rows of sources drawn more often than their
    size; `limit` stops after that many picks (the same first picks: --max_samples).
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    total = sum(probs)
    p = [v / total for v in probs]
    next_row, used_up = [0] * len(lengths), [False] * len(lengths)
    order: list[tuple[int, int]] = []
    while limit is None or len(order) < limit:
        for source in rng.choice(len(lengths), size=1000, p=p).tolist():
            if all(used_up) or (limit is not None and len(order) >= limit):
                return order
            order.append((source, next_row[source]))
            next_row[source] += 1
            if next_row[source] >= lengths[source]:
                used_up[source], next_row[source] = True, 0
    return order


def load_prompt_mix(
    prompt_data: str,
    probs: str | None,
    split: str,
    input_key: str,
    label_key: str | None,
    max_samples: int | None,
    seed: int,
) -> PromptRows:
    """Rows of every --prompt_data source (each read by load_prompt_rows, at most max_samples each), then
    concatenated in the given order, or mixed by --prompt_data_probs (interleave_order, seeded by --seed);
    at most max_samples rows in all, as OpenRLHF's blending_datasets and its caller.

    With several sources, Prompt.index (build_prompts) is the row's position in this mixed list.
    """
    sources = split_sources(prompt_data)
    weights = parse_probs(probs, sources) if probs is not None else None
    tables = [load_prompt_rows(src, input_key, label_key, max_samples, split=split) for src in sources]
    if weights is None:
        rows = PromptRows.concat(tables)
    else:
        order = interleave_order([len(t) for t in tables], weights, seed, limit=max_samples)
        rows = PromptRows([tables[src][i] for src, i in order], [tables[src].origins[i] for src, i in order])
    if len(sources) > 1:
        logger.info(
            "prompt data: %s -> %d rows %s",
            ", ".join(f"{s} ({len(t)} rows)" for s, t in zip(sources, tables)),
            len(rows),
            f"mixed by --prompt_data_probs {probs}" if weights else "concatenated",
        )
    return rows.head(max_samples)
