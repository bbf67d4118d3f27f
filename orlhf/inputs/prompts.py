"""Prompts: file -> rows -> formatted, tokenized Prompts -> shuffled batches, resumable.

    --prompt_data --load_prompt_rows()--> list[dict]          (jsonl | json | parquet | saved HF dataset folder)
       a,b,...    --prompt_mix.load_prompt_mix()--> list[dict]   (each source as above; concatenated, or mixed
                                                                  by --prompt_data_probs)
                  --build_prompts()-----> list[Prompt], PromptStats   (template, tokenize, length policy;
                                                                  the tokenizer: inputs/tokenizer.py)
                  --PromptLoader--------> list[Prompt] per step (inputs/prompt_loader.py: rollout_batch_size,
                                                                  reshuffled each episode)

Invariants:
- Prompt.text is exactly the string the model is prompted with, and Prompt.ids its tokens; for a truncated prompt
  text is the decoded kept tokens, so the reward function's `prompts[i]` is still a prefix of `queries[i]`.
- Prompt.index is the 0-based row index in the file, stable under skipping and shuffling (for debugging a row);
  with several --prompt_data sources, the row's position in the mixed list (inputs/prompt_mix.py).
- The loader's order depends only on (seed, episode): a run resumed from PromptLoader.state_dict() yields the
  same batches an uninterrupted run would have.
Messages use 1-based positions ("line 17" for JSONL, "row 17" otherwise), as editors and `sed -n 17p` do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ".jsonl, .json, .parquet, a folder written by datasets' save_to_disk, or a hub dataset id (online)"
SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """The prompt data or tokenizer cannot be used; the message names the file/flag and the fix."""


# ---- Reading rows ----


def load_prompt_rows(
    path: str, input_key: str, label_key: str | None, max_samples: int | None, split: str = "train"
) -> list[dict]:
    """The first `max_samples` rows of `path` (all if None), each checked to hold `input_key` (and `label_key`).
    `split` picks the split of a saved DatasetDict or a hub dataset (files have none).

    Rows with an empty prompt are kept here (build_prompts skips and counts them) unless every prompt is empty.
    `split` (--prompt_split) picks the split of a saved DatasetDict folder or hub dataset; a file is one split.
    """
    rows, locs = _read_rows(Path(path).expanduser(), path, max_samples, split)
    if not rows:
        raise DataError(f"--prompt_data {path}: no rows; point --prompt_data at a file with one prompt per row.")
    for row, loc in zip(rows, locs):
        if not isinstance(row, dict):
            raise DataError(
                f'{path} {loc}: expected an object like {{"{input_key}": "..."}}, '
                f"got {type(row).__name__}; fix or remove that row."
            )
        for key, flag in ((input_key, "--input_key"), (label_key, "--label_key")):
            if key is not None and key not in row:
                raise DataError(
                    f"{path} {loc}: no field {key!r} ({flag}); the row has fields {sorted(row)}. "
                    f"Set {flag} to one of them, or add {key!r} to every row."
                )
        if not isinstance(row[input_key], (str, list, type(None))):
            raise DataError(
                f"{path} {loc}: the prompt ({input_key!r}, --input_key) is a "
                f"{type(row[input_key]).__name__}; it must be text (or a list of chat messages)."
            )
    if all(_is_empty(row[input_key]) for row in rows):
        raise DataError(
            f"{path}: every prompt in field {input_key!r} (--input_key) is empty; "
            "is --input_key the field that holds the prompt text?"
        )
    return rows


def _read_rows(path: Path, given: str, max_samples: int | None, split: str = "train") -> tuple[list[Any], list[str]]:
    """(rows, where each row is: "line N" or "row N") for every supported format."""
    if path.is_file() and split != "train":
        # OpenRLHF reads a file as a dataset with the one split "train" (and crashes on another --prompt_split).
        raise DataError(
            f"--prompt_split {split}: {given} is a single file, whose only split is 'train'; use "
            "--prompt_split train, or pass the file of the split you mean."
        )
    if not path.exists():
        if path.suffix in SUFFIXES:
            raise DataError(f"--prompt_data {given}: no such file.")
        rows = _read_hub_dataset(given, max_samples, split)
    elif path.is_dir():
        rows = _read_saved_dataset(path, max_samples, split)
    elif path.suffix == ".jsonl":
        return _read_jsonl(path, max_samples)
    elif path.suffix == ".json":
        return _read_json(path, max_samples)
    elif path.suffix == ".parquet":
        rows = _read_parquet(path, max_samples)
    else:
        raise DataError(f"--prompt_data {given}: unsupported format {path.suffix!r}; use {FORMATS}.")
    return rows, [f"row {i + 1}" for i in range(len(rows))]


def _read_jsonl(path: Path, max_samples: int | None) -> tuple[list[Any], list[str]]:
    # Parsed line by line (not via datasets) so a bad line is reported with its number instead of an Arrow error.
    rows, locs = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if max_samples is not None and len(rows) >= max_samples:
                break
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a UTF-8 BOM (Windows editors): ok
                if not line.strip():
                    continue  # blank lines (a trailing newline, a separator) are not rows
                rows.append(json.loads(line))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{path} line {lineno}: {e}; fix or remove that line.") from None
            locs.append(f"line {lineno}")
    return rows, locs


def _read_json(path: Path, max_samples: int | None) -> tuple[list[Any], list[str]]:
    """A list of objects, HF's column layout {"col": [...], ...}, or {"data": [objects]}; JSON lines also work."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))  # utf-8-sig: with or without a BOM
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object per line in a .json file: datasets accepts it, so do we
            return _read_jsonl(path, max_samples)
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
    obj = obj[:max_samples] if max_samples is not None else obj
    return obj, [f"row {i + 1}" for i in range(len(obj))]


def _read_parquet(path: Path, max_samples: int | None) -> list[Any]:
    import pyarrow.parquet as pq  # datasets' own backend; read directly so nothing is written to a cache

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: cannot read as parquet ({type(e).__name__}: {e}).") from e
    if max_samples is not None:
        table = table.slice(0, max_samples)
    return table.to_pylist()


def _read_saved_dataset(path: Path, max_samples: int | None, split: str = "train") -> list[Any]:
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
        ds = ds[split]
    elif split != "train":
        raise DataError(
            f"--prompt_split {split}: {path} holds one dataset, not a DatasetDict of splits; use "
            "--prompt_split train, or pass the folder of the split you mean."
        )
    return _first_rows(ds, max_samples)


def _read_hub_dataset(name: str, max_samples: int | None, split: str = "train") -> list[Any]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(
            f"--prompt_data {name}: no such file or folder, and loading it as a hub dataset failed "
            f"({type(e).__name__}: {e}); use {FORMATS}."
        ) from e
    return _first_rows(ds, max_samples)


def _first_rows(ds, max_samples: int | None) -> list[Any]:
    n = len(ds) if max_samples is None else min(max_samples, len(ds))
    return ds.select(range(n)).to_list()


def _is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return value is None or (isinstance(value, list) and not value)  # None / [] : no prompt in this row


# ---- Formatting and tokenizing ----


@dataclass(frozen=True)
class Prompt:
    text: str  # the formatted prompt string the model is prompted with (template / chat template applied)
    ids: list[int]  # its tokens, at most --prompt_max_len
    label: Any | None  # the --label_key value, None without --label_key
    index: int  # 0-based row index in the file


@dataclass
class PromptStats:
    total: int  # rows read
    used: int
    skipped_empty: int
    skipped_too_long: int
    truncated: int

    def summary(self) -> str:
        return (
            f"prompts: {self.used} of {self.total} used ({self.skipped_empty} empty skipped, "
            f"{self.skipped_too_long} longer than --prompt_max_len skipped, {self.truncated} truncated)"
        )


def format_prompts(rows: list[dict], tokenizer, data, prompt_max_len: int) -> tuple[list[Prompt], PromptStats]:
    """build_prompts with a run's data flags (config's DataConfig: input_key, label_key, apply_chat_template,
    input_template, prompt_overflow): training and evaluation prompts are formatted the one same way."""
    return build_prompts(
        rows,
        tokenizer,
        data.input_key,
        data.label_key,
        data.apply_chat_template,
        data.input_template,
        prompt_max_len,
        data.prompt_overflow,
    )


def build_prompts(
    rows: list[dict],
    tokenizer,
    input_key: str,
    label_key: str | None,
    apply_chat_template: bool,
    input_template: str | None,
    prompt_max_len: int,
    overflow: str = "skip",
) -> tuple[list[Prompt], PromptStats]:
    """Format and tokenize rows. Longer than prompt_max_len tokens: "skip" drops the prompt; "truncate" keeps its
    last tokens (the question's end, next to where the answer starts, matters most), plus a leading BOS if any.
    """
    if overflow not in ("skip", "truncate"):
        raise ValueError(f"overflow must be 'skip' or 'truncate', got {overflow!r}")
    if apply_chat_template and input_template:
        raise DataError(
            "--input_template and --apply_chat_template are both given; choose one way to format "
            "prompts (OpenRLHF would ignore --input_template silently)."
        )
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"--apply_chat_template: the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has "
            "no chat template; drop --apply_chat_template (use --input_template) or use a chat model."
        )
    kept = [(i, row) for i, row in enumerate(rows) if not _is_empty(row[input_key])]
    texts = [_format(row[input_key], i, input_key, tokenizer, apply_chat_template, input_template) for i, row in kept]
    # Chat templates already contain the model's special tokens; plain text gets them from the tokenizer (BOS).
    all_ids = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"] if texts else []
    stats = PromptStats(total=len(rows), used=0, skipped_empty=len(rows) - len(kept), skipped_too_long=0, truncated=0)
    prompts = []
    for (i, row), text, ids in zip(kept, texts, all_ids):
        if len(ids) > prompt_max_len:
            if overflow == "skip":
                stats.skipped_too_long += 1
                continue
            ids = _keep_end(ids, prompt_max_len, tokenizer.bos_token_id)
            text = tokenizer.decode(ids)
            stats.truncated += 1
        prompts.append(Prompt(text=text, ids=list(ids), label=row[label_key] if label_key else None, index=i))
    stats.used = len(prompts)
    if not prompts:
        raise DataError(
            f"no prompts left: {stats.summary()}. Raise --prompt_max_len (now {prompt_max_len}) or "
            "use --prompt_overflow truncate."
        )
    return prompts, stats


def _format(value: Any, index: int, key: str, tokenizer, apply_chat_template: bool, input_template: str | None) -> str:
    if apply_chat_template:
        # A row may hold a whole conversation ([{"role", "content"}, ...]), as OpenRLHF allows.
        messages = value if isinstance(value, list) else [{"role": "user", "content": str(value)}]
        _check_messages(messages, index, key)
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2 errors of the model's own template: name the row, not the template line
            raise DataError(
                f"row {index + 1}: the chat template failed on this conversation "
                f"({type(e).__name__}: {e}); check its roles and contents."
            ) from None
    if not isinstance(value, str):
        raise DataError(
            f"row {index + 1}: the prompt ({key!r}, --input_key) is a list of chat messages, which "
            "needs --apply_chat_template."
        )
    return input_template.format(value) if input_template else value


def _check_messages(messages: list, index: int, key: str) -> None:
    """A conversation is a list of {"role": str, "content": str}; anything else fails inside Jinja, unreadably."""
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            got = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise DataError(
                f"row {index + 1}: message {j + 1} of the conversation in {key!r} (--input_key) needs "
                f'"role" and "content" strings, got {got}; fix that row, e.g. '
                '{"role": "user", "content": "..."}.'
            )


def _keep_end(ids: list[int], max_len: int, bos_id: int | None) -> list[int]:
    head = ids[:1] if bos_id is not None and ids and ids[0] == bos_id and max_len > 1 else []
    return head + ids[len(ids) - (max_len - len(head)) :]
