"""Prompt sources read row by row: each row checked as it is read, with where it is (file and line), never the whole
file held when it need not be.

    --prompt_data (one source) --iter_prompt_rows()--> (row, where, folder), one at a time
        .jsonl    line by line                              progress: bytes of the file
        .parquet  a record batch at a time                  progress: rows
        saved HF dataset folder, hub dataset id: a slice of rows at a time (memory-mapped by datasets)
        .json     parsed whole (JSON has no rows before it is parsed), then row by row
    load_prompt_rows() -> PromptRows: the same rows in a list, each with its origin (small sources, tests)

A bar ("prompts <file>") shows how far reading has come once it has taken longer than PROGRESS_DELAY_S, and is gone
when it ends: a small file shows nothing. Messages use 1-based positions ("line 17" for JSONL, "row 17" otherwise),
as editors and `sed -n 17p` do.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from orlhf.inputs.errors import DataError

FORMATS = ".jsonl, .json, .parquet, a folder written by datasets' save_to_disk, or a hub dataset id (online)"
SUFFIXES = (".jsonl", ".json", ".parquet")
PROGRESS_DELAY_S = 1.0  # a read that ends sooner shows no bar
SLICE_ROWS = 1024  # rows taken at a time from a parquet file or a datasets table


class PromptRows(list):
    """Rows (dicts) of prompt sources, each with its origin: (where, folder). `where` names it in messages
    ("data/p.jsonl line 3"); `folder` is where a relative image path is also looked up (the data file's folder,
    a saved dataset's folder; None for a hub dataset). A plain list of rows works wherever PromptRows does."""

    def __init__(self, rows=(), origins=()):
        super().__init__(rows)
        self.origins: list[tuple[str, Optional[Path]]] = list(origins)

    @classmethod
    def concat(cls, parts: list[PromptRows]) -> PromptRows:
        return cls([r for p in parts for r in p], [o for p in parts for o in p.origins])

    def head(self, n: Optional[int]) -> PromptRows:
        return self if n is None else PromptRows(self[:n], self.origins[:n])


def load_prompt_rows(
    path: str, input_key: str, label_key: str | None, max_samples: int | None, split: str = "train"
) -> PromptRows:
    """The first `max_samples` rows of `path` (all if None) in a list, as iter_prompt_rows reads and checks them."""
    rows = PromptRows()
    for row, where, folder in iter_prompt_rows(path, input_key, label_key, max_samples, split):
        rows.append(row)
        rows.origins.append((where, folder))
    return rows


def iter_prompt_rows(
    path: str, input_key: str, label_key: str | None, max_samples: int | None, split: str = "train"
) -> Iterator[tuple[dict, str, Optional[Path]]]:
    """(row, where, folder) for the first `max_samples` rows of `path` (all if None), each checked to be an object
    holding `input_key` (and `label_key`) with a text or chat prompt. `split` (--prompt_split) picks the split of a
    saved DatasetDict folder or hub dataset; a file is one split. Rows with an empty prompt are yielded (the
    prompt builder skips and counts them); a source without rows, or whose every prompt is empty, is a DataError
    once it has been read."""
    local = Path(path).expanduser()
    folder = local if local.is_dir() else local.parent if local.is_file() else None
    rows = empty = 0
    with _progress(local) as bar:
        for row, loc in _read_rows(local, path, max_samples, split, bar):
            _check_row(row, f"{path} {loc}", input_key, label_key)
            rows += 1
            empty += is_empty(row[input_key])
            yield row, f"{path} {loc}", folder
    if not rows:
        raise DataError(f"--prompt_data {path}: no rows; point --prompt_data at a file with one prompt per row.")
    if empty == rows:
        raise DataError(
            f"{path}: every prompt in field {input_key!r} (--input_key) is empty; "
            "is --input_key the field that holds the prompt text?"
        )


def is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return value is None or (isinstance(value, list) and not value)  # None / [] : no prompt in this row


def _check_row(row: Any, where: str, input_key: str, label_key: str | None) -> None:
    if not isinstance(row, dict):
        raise DataError(
            f'{where}: expected an object like {{"{input_key}": "..."}}, got {type(row).__name__}; '
            "fix or remove that row."
        )
    for key, flag in ((input_key, "--input_key"), (label_key, "--label_key")):
        if key is not None and key not in row:
            raise DataError(
                f"{where}: no field {key!r} ({flag}); the row has fields {sorted(row)}. "
                f"Set {flag} to one of them, or add {key!r} to every row."
            )
    if not isinstance(row[input_key], (str, list, type(None))):
        raise DataError(
            f"{where}: the prompt ({input_key!r}, --input_key) is a "
            f"{type(row[input_key]).__name__}; it must be text (or a list of chat messages)."
        )


@contextmanager
def _progress(path: Path):
    """A bar for reading `path` (bytes of a JSONL file, else rows), drawn only once the read is slow, then gone."""
    from tqdm import tqdm

    jsonl = path.suffix == ".jsonl" and path.is_file()
    bar = tqdm(
        total=path.stat().st_size if jsonl else None,
        desc=f"prompts {path.name}",
        unit="B" if jsonl else " rows",
        unit_scale=True,
        delay=PROGRESS_DELAY_S,
        leave=False,
        dynamic_ncols=True,
    )
    try:
        yield bar
    finally:
        bar.close()


def _read_rows(path: Path, given: str, max_samples: int | None, split: str, bar) -> Iterator[tuple[Any, str]]:
    """(row, where it is: "line N" or "row N") for every supported format."""
    if path.is_file() and split != "train":
        # OpenRLHF reads a file as a dataset with the one split "train" (and crashes on another --prompt_split).
        raise DataError(
            f"--prompt_split {split}: {given} is a single file, whose only split is 'train'; use "
            "--prompt_split train, or pass the file of the split you mean."
        )
    if not path.exists():
        if path.suffix in SUFFIXES:
            raise DataError(f"--prompt_data {given}: no such file.")
        rows = _slices(_hub_dataset(given, split), max_samples)
    elif path.is_dir():
        rows = _slices(_saved_dataset(path, split), max_samples)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path, max_samples, bar)
        return
    elif path.suffix == ".json":
        yield from _read_json(path, max_samples, bar)
        return
    elif path.suffix == ".parquet":
        rows = _read_parquet(path, max_samples)
    else:
        raise DataError(f"--prompt_data {given}: unsupported format {path.suffix!r}; use {FORMATS}.")
    for i, row in enumerate(rows):
        bar.update(1)
        yield row, f"row {i + 1}"


def _read_jsonl(path: Path, max_samples: int | None, bar) -> Iterator[tuple[Any, str]]:
    # Parsed line by line (not via datasets) so a bad line is reported with its number instead of an Arrow error.
    rows = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            bar.update(len(raw))
            if max_samples is not None and rows >= max_samples:
                break
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a UTF-8 BOM (Windows editors): ok
                if not line.strip():
                    continue  # blank lines (a trailing newline, a separator) are not rows
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{path} line {lineno}: {e}; fix or remove that line.") from None
            rows += 1
            yield row, f"line {lineno}"


def _read_json(path: Path, max_samples: int | None, bar) -> Iterator[tuple[Any, str]]:
    """A list of objects, HF's column layout {"col": [...], ...}, or {"data": [objects]}; JSON lines also work."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))  # utf-8-sig: with or without a BOM
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object per line in a .json file: datasets accepts it, so do we
            yield from _read_jsonl(path, max_samples, bar)
            return
        raise DataError(f"{path} line {e.lineno}: {e}; fix the JSON (a list of objects is expected).") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); save it as UTF-8.") from None
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list)]
        if len(obj) == 1 and lists and all(isinstance(r, dict) for r in lists[0]):
            obj = lists[0]  # {"data": [{...}, ...]}: the layout datasets reads with field="data"
        elif len(lists) == len(obj) and len({len(v) for v in lists}) == 1:
            obj = [dict(zip(obj, vals)) for vals in zip(*lists)]  # columns of equal length
        else:
            raise DataError(
                f"{path}: expected a list of objects or columns of equal length, got an object with "
                f"keys {sorted(obj)[:10]}; convert it to JSONL (one object per line)."
            )
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a list of objects, got {type(obj).__name__}.")
    for i, row in enumerate(obj[:max_samples] if max_samples is not None else obj):
        bar.update(1)
        yield row, f"row {i + 1}"


def _read_parquet(path: Path, max_samples: int | None) -> Iterator[Any]:
    import pyarrow.parquet as pq  # datasets' own backend; read directly so nothing is written to a cache

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=SLICE_ROWS)
        left = max_samples
        for batch in batches:
            rows = batch.to_pylist()
            if left is not None:
                rows, left = rows[:left], left - min(left, len(rows))
            yield from rows
            if left == 0:
                return
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e}).") from e


def _saved_dataset(path: Path, split: str):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(
            f"{path}: a folder, but not one written by datasets' save_to_disk ({type(e).__name__}: {e}); use {FORMATS}."
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(
                f"--prompt_split {split}: {path} has no split {split!r} (splits: {sorted(ds)}); "
                f"pick one with --prompt_split, e.g. --prompt_split {sorted(ds)[0]}."
            )
        return ds[split]
    if split != "train":
        raise DataError(
            f"--prompt_split {split}: {path} holds one dataset, not a DatasetDict of splits; use "
            "--prompt_split train, or pass the folder of the split you mean."
        )
    return ds


def _hub_dataset(name: str, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(
            f"--prompt_data {name}: no such file or folder, and loading it as a hub dataset failed "
            f"({type(e).__name__}: {e}); use {FORMATS}."
        ) from e


def _slices(ds, max_samples: int | None) -> Iterator[dict]:
    """The first `max_samples` rows of a datasets table, SLICE_ROWS at a time (its columns stay memory-mapped)."""
    n = len(ds) if max_samples is None else min(max_samples, len(ds))
    for start in range(0, n, SLICE_ROWS):
        yield from ds.select(range(start, min(start + SLICE_ROWS, n))).to_list()  # undecoded, as stored
