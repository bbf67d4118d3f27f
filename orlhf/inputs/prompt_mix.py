"""Several prompt sources, as OpenRLHF's blending_datasets takes them: --prompt_data a,b [--prompt_data_probs].

    --prompt_data "a,b" --split_sources--> [a, b] --each read (--prompt_split, --max_samples) into a table:
        read_prompts:     its rows streamed through prompts.PromptBuilder (a Prompt or a skip per row)
        load_prompt_mix:  its rows (prompt_rows.load_prompt_rows)
    --> mixed: no --prompt_data_probs:   a's then b's (concatenated)
               --prompt_data_probs p,q:  drawn source by source (interleave_order), until every source was used up
    --> at most --max_samples in all (--> read_prompts: PromptBuilder.assemble: Prompt.index the mixed position)

A run reads with read_prompts: each row is formatted and tokenized once, even when the mix repeats it, and only the
prompts kept stay in memory. One source without --prompt_data_probs reads exactly as that source alone. The mix
depends only on (the sources' lengths, the probabilities, --seed), so a resumed run rebuilds the same list.
"""

from __future__ import annotations

import logging
from typing import Callable

from orlhf.inputs.errors import DataError
from orlhf.inputs.prompt_rows import PromptRows, iter_prompt_rows, load_prompt_rows
from orlhf.inputs.prompts import Prompt, PromptBuilder, PromptStats

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


def read_prompts(
    prompt_data: str, probs: str | None, split: str, max_samples: int | None, seed: int, builder: PromptBuilder
) -> tuple[list[Prompt], PromptStats]:
    """The prompts of every --prompt_data source, mixed as load_prompt_mix mixes rows (Prompt.index: the position
    in the mixed list), each source's rows formatted and tokenized by `builder` as they are read."""

    def read(source: str) -> list:
        rows = iter_prompt_rows(source, builder.input_key, builder.label_key, max_samples, split=split)
        return builder.outcomes(rows)

    return builder.assemble(_mixed(prompt_data, probs, max_samples, seed, read))


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
    at most max_samples rows in all, as OpenRLHF's blending_datasets and its caller."""
    return _mixed(
        prompt_data,
        probs,
        max_samples,
        seed,
        lambda src: load_prompt_rows(src, input_key, label_key, max_samples, split),
    )


def _mixed(prompt_data: str, probs: str | None, max_samples: int | None, seed: int, read: Callable[[str], list]):
    """What `read` gives for each source (a list per source, one item per row), concatenated or mixed by `probs`,
    at most max_samples items; PromptRows (with their origins) when `read` gives PromptRows."""
    sources = split_sources(prompt_data)
    weights = parse_probs(probs, sources) if probs is not None else None
    tables = [read(src) for src in sources]
    rows = all(isinstance(t, PromptRows) for t in tables)
    if weights is None:
        mixed = tables[0] if len(tables) == 1 else PromptRows.concat(tables) if rows else [x for t in tables for x in t]
    else:
        order = interleave_order([len(t) for t in tables], weights, seed, limit=max_samples)
        mixed = [tables[s][i] for s, i in order]
        mixed = PromptRows(mixed, [tables[s].origins[i] for s, i in order]) if rows else mixed
    if len(sources) > 1:
        logger.info(
            "prompt data: %s -> %d rows %s",
            ", ".join(f"{s} ({len(t)} rows)" for s, t in zip(sources, tables)),
            len(mixed),
            f"mixed by --prompt_data_probs {probs}" if weights else "concatenated",
        )
    if max_samples is None or len(mixed) <= max_samples:
        return mixed
    return mixed.head(max_samples) if rows else mixed[:max_samples]
