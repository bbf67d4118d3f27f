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
- load_prompt_rows returns PromptRows: each row with its origin (the file and its line or row), kept through the mix,
  so an error found while formatting (a row's image) still names the file and line.
Messages use 1-based positions ("line 17" for JSONL, "row 17" otherwise), as editors and `sed -n 17p` do.

Vision-language models (--max_images_per_prompt > 0, a processor given): a row's images (--image_key) are read as
encoded files (inputs/images.py), the chat template may hold {"type": "image"} items, and each image prompt gets two
tokenizations: `engine_ids` (one placeholder per image, what vLLM expands itself) and `ids` (the processor's
expansion, what the trainers score, counted against --prompt_max_len).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from orlhf.inputs.chat_format import PromptFormat
from orlhf.inputs.errors import DataError
from orlhf.inputs.images import image_prompt_ids, load_processor, row_images

FORMATS = ".jsonl, .json, .parquet, a folder written by datasets' save_to_disk, or a hub dataset id (online)"
SUFFIXES = (".jsonl", ".json", ".parquet")

logger = logging.getLogger(__name__)


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


# ---- Reading rows ----


def load_prompt_rows(
    path: str, input_key: str, label_key: str | None, max_samples: int | None, split: str = "train"
) -> PromptRows:
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
    local = Path(path).expanduser()
    folder = local if local.is_dir() else local.parent if local.is_file() else None
    return PromptRows(rows, [(f"{path} {loc}", folder) for loc in locs])


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
    # Vision-language models (--max_images_per_prompt > 0): the row's images (--image_key) as encoded files (bytes),
    # in prompt order; () for a text prompt. `ids` are then the processor's (each image placeholder expanded to the
    # image's tokens: what the trainers score), `engine_ids` the template's tokens with one placeholder per image
    # (what a vLLM engine is given: it expands them itself). None: the engines get `ids`.
    images: tuple = ()
    engine_ids: list[int] | None = None


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


def format_prompts(
    rows: list[dict], tokenizer, data, prompt_max_len: int, processor=None
) -> tuple[list[Prompt], PromptStats]:
    """build_prompts with a run's data flags (config's DataConfig: input_key, label_key, apply_chat_template,
    input_template, prompt_overflow, image_key, max_images_per_prompt): training and evaluation prompts are
    formatted the one same way. With --max_images_per_prompt > 0, `processor` is --pretrain's (loaded here when
    not given: inputs/images.load_processor)."""
    if data.max_images_per_prompt > 0 and processor is None:
        processor = load_processor(data.pretrain)
    return build_prompts(
        rows,
        tokenizer,
        data.input_key,
        data.label_key,
        data.apply_chat_template,
        data.input_template,
        prompt_max_len,
        data.prompt_overflow,
        processor=processor if data.max_images_per_prompt > 0 else None,
        image_key=data.image_key,
        max_images=data.max_images_per_prompt,
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
    processor=None,
    image_key: str = "images",
    max_images: int = 0,
) -> tuple[list[Prompt], PromptStats]:
    """Format and tokenize rows. Longer than prompt_max_len tokens: "skip" drops the prompt; "truncate" keeps its
    last tokens (the question's end, next to where the answer starts, matters most), plus a leading BOS if any.

    With a processor (a vision-language model: max_images > 0), each row's images (field image_key, at most
    max_images) are read, the chat template is the processor's, and an image prompt's ids are the processor's
    expansion (module docstring); "truncate" is refused (a cut would separate image tokens from their image).
    """
    vision = processor is not None
    # A vision-language model's processor holds the chat template that places images; else the tokenizer's.
    templater = processor if vision and getattr(processor, "chat_template", None) else tokenizer
    _check_format_flags(overflow, vision, apply_chat_template, input_template, templater, tokenizer)
    if not vision:
        _warn_unused_images(rows, image_key)
    kept = [(i, row) for i, row in enumerate(rows) if not _is_empty(row[input_key])]
    fmt = PromptFormat(input_key, templater, apply_chat_template, input_template, vision)
    texts = [fmt(row[input_key], i) for i, row in kept]
    # Chat templates already contain the model's special tokens; plain text gets them from the tokenizer (BOS).
    special = not apply_chat_template
    if vision:
        encoded = _encode_images(rows, kept, texts, processor, tokenizer, image_key, max_images, special)
    else:
        all_ids = tokenizer(texts, add_special_tokens=special)["input_ids"] if texts else []
        encoded = [(ids, None, ()) for ids in all_ids]
    stats = PromptStats(total=len(rows), used=0, skipped_empty=len(rows) - len(kept), skipped_too_long=0, truncated=0)
    prompts = []
    for (i, row), text, (ids, engine_ids, images) in zip(kept, texts, encoded):
        if len(ids) > prompt_max_len:
            if overflow == "skip":
                stats.skipped_too_long += 1
                continue
            ids = _keep_end(ids, prompt_max_len, tokenizer.bos_token_id)
            text = tokenizer.decode(ids)
            stats.truncated += 1
        label = row[label_key] if label_key else None
        prompts.append(Prompt(text, list(ids), label, i, images=images, engine_ids=engine_ids))
    stats.used = len(prompts)
    if not prompts:
        also = "" if vision else " or use --prompt_overflow truncate"
        raise DataError(f"no prompts left: {stats.summary()}. Raise --prompt_max_len (now {prompt_max_len}){also}.")
    return prompts, stats


def _check_format_flags(
    overflow: str, vision: bool, apply_chat_template: bool, input_template: str | None, templater, tokenizer
) -> None:
    """The formatting flags that cannot work together or with this model, refused before any row is read."""
    if overflow not in ("skip", "truncate"):
        raise ValueError(f"overflow must be 'skip' or 'truncate', got {overflow!r}")
    if vision and overflow == "truncate":
        raise DataError(
            "--prompt_overflow truncate with vision-language prompts (--max_images_per_prompt > 0): a cut prompt "
            "loses its image tokens' alignment; use --prompt_overflow skip (the default) or raise --prompt_max_len."
        )
    if apply_chat_template and input_template:
        raise DataError(
            "--input_template and --apply_chat_template are both given; choose one way to format "
            "prompts (OpenRLHF would ignore --input_template silently)."
        )
    if apply_chat_template and not getattr(templater, "chat_template", None):
        raise DataError(
            f"--apply_chat_template: the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has "
            "no chat template; drop --apply_chat_template (use --input_template) or use a chat model."
        )


def _encode_images(
    rows: list[dict], kept: list, texts: list[str], processor, tokenizer, image_key: str, max_images: int, special
) -> list[tuple[list[int], list[int], tuple]]:
    """(ids, engine_ids, images) per kept row of a vision-language run: the row's images read (naming the row's
    file and line on an error) and the prompt tokenized twice (module docstring)."""
    origins = getattr(rows, "origins", None) or [(f"row {i + 1}", None) for i in range(len(rows))]
    encoded = []
    for (i, row), text in zip(kept, texts):
        where, folder = origins[i]
        images = row_images(row, image_key, max_images, where, folder)
        encoded.append((*image_prompt_ids(processor, tokenizer, text, images, where, special), images))
    return encoded


def _warn_unused_images(rows: list[dict], image_key: str) -> None:
    """A text run over rows that hold images: said once (the images are not used), not silently dropped."""
    n = sum(1 for row in rows if isinstance(row, dict) and not _is_empty(row.get(image_key)))
    if n:
        logger.warning(
            "%d prompt rows have images in %r (--image_key), which this text run does not use; "
            "--max_images_per_prompt N trains a vision-language model on them",
            n,
            image_key,
        )


def _keep_end(ids: list[int], max_len: int, bos_id: int | None) -> list[int]:
    head = ids[:1] if bos_id is not None and ids and ids[0] == bos_id and max_len > 1 else []
    return head + ids[len(ids) - (max_len - len(head)) :]
