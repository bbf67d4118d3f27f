"""Prompts: rows -> formatted, tokenized Prompts, a chunk of rows at a time, keeping only the prompts a run uses.

    --prompt_data --prompt_rows.iter_prompt_rows()--> (row, where, folder), one at a time
       a,b,...    --prompt_mix.read_prompts()----> each source through PromptBuilder.outcomes, then mixed
                  --PromptBuilder.outcomes()----> per row a Prompt, or why none (EMPTY, TOO_LONG): CHUNK_ROWS rows
                                                  formatted (template) and tokenized together, then let go
                  --PromptBuilder.assemble()----> list[Prompt], PromptStats (indices, counts)
                  --PromptLoader----------------> list[Prompt] per step (inputs/prompt_loader.py)
    build_prompts(rows, ...) = outcomes + assemble over rows already in a list.

Invariants:
- Prompt.text is exactly the string the model is prompted with, and Prompt.ids its tokens; for a truncated prompt
  text is the decoded kept tokens, so the reward function's `prompts[i]` is still a prefix of `queries[i]`.
- Prompt.index is the 0-based row index in the file, stable under skipping and shuffling (for debugging a row);
  with several --prompt_data sources, the row's position in the mixed list (inputs/prompt_mix.py).
- Memory holds the prompts kept and one chunk of rows, not the file: a row longer than --prompt_max_len is never
  tokenized whole (below).

Over-long rows are decided from a window of their text. A text longer than window_chars (a generous bound on what
prompt_max_len + TOKEN_SLACK tokens can span) is tokenized from its start ("skip") or its end ("truncate"), cut at
whitespace, the window growing fourfold until its tokens exceed prompt_max_len + TOKEN_SLACK or it is the whole text.
Tokenizers that split text into words first tokenize a window cut between words exactly as they tokenize that part of
the whole text, so a window over the limit means the text is; TOKEN_SLACK covers what happens at the cut otherwise.
"skip" then drops the row, "truncate" keeps the last tokens of the end window: the same tokens the whole text ends in.

Vision-language models (--max_images_per_prompt > 0, a processor given): a row's images (--image_key) are read as
encoded files (inputs/images.py), the chat template may hold {"type": "image"} items, and each image prompt gets two
tokenizations: `engine_ids` (one placeholder per image, what vLLM expands itself) and `ids` (the processor's
expansion, what the trainers score, counted against --prompt_max_len). Such rows are tokenized whole.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from orlhf.inputs.chat_format import PromptFormat
from orlhf.inputs.errors import DataError
from orlhf.inputs.images import image_prompt_ids, load_processor, row_images
from orlhf.inputs.prompt_rows import is_empty

logger = logging.getLogger(__name__)

EMPTY, TOO_LONG = "empty", "too long"  # a row's outcome when it gives no prompt
CHUNK_ROWS = 512  # rows formatted and tokenized together
TOKEN_SLACK = 32  # tokens a window's cut may add or lose
CHARS_PER_TOKEN = 8  # window_chars: this many characters per token, more than common tokenizers' text averages


@dataclass(frozen=True, slots=True)  # slots: a run may hold millions
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
    truncated: bool = False  # the row was longer than --prompt_max_len: text and ids are its end ("truncate")


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
    """build_prompts with a run's data flags (builder_for)."""
    return builder_for(tokenizer, data, prompt_max_len, processor).build(rows)


def builder_for(tokenizer, data, prompt_max_len: int, processor=None) -> PromptBuilder:
    """The PromptBuilder of a run's data flags (config's DataConfig: input_key, label_key, apply_chat_template,
    input_template, prompt_overflow, image_key, max_images_per_prompt): training and evaluation prompts are
    formatted the one same way. With --max_images_per_prompt > 0, `processor` is --pretrain's (loaded here when
    not given: inputs/images.load_processor)."""
    if data.max_images_per_prompt > 0 and processor is None:
        processor = load_processor(data.pretrain)
    return PromptBuilder(
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


def build_prompts(rows: list[dict], tokenizer, *args, **kwargs) -> tuple[list[Prompt], PromptStats]:
    """Format and tokenize rows (PromptBuilder's arguments after the tokenizer). Longer than prompt_max_len tokens:
    "skip" drops the prompt; "truncate" keeps its last tokens (the question's end, next to where the answer starts,
    matters most), plus a leading BOS if any."""
    return PromptBuilder(tokenizer, *args, **kwargs).build(rows)


class PromptBuilder:
    """Rows -> Prompts, CHUNK_ROWS at a time (module docstring). With a processor (a vision-language model:
    max_images > 0), each row's images (field image_key, at most max_images) are read, the chat template is the
    processor's, and an image prompt's ids are the processor's expansion; "truncate" is refused (a cut would
    separate image tokens from their image)."""

    def __init__(
        self,
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
    ):
        vision = processor is not None
        # A vision-language model's processor holds the chat template that places images; else the tokenizer's.
        templater = processor if vision and getattr(processor, "chat_template", None) else tokenizer
        _check_format_flags(overflow, vision, apply_chat_template, input_template, templater, tokenizer)
        self.tokenizer, self.processor, self.max_len, self.overflow = tokenizer, processor, prompt_max_len, overflow
        self.input_key, self.label_key, self.image_key, self.max_images = input_key, label_key, image_key, max_images
        self.format = PromptFormat(input_key, templater, apply_chat_template, input_template, vision)
        self.special = not apply_chat_template  # chat templates hold the model's special tokens; plain text gets BOS
        self.window_chars = CHARS_PER_TOKEN * (prompt_max_len + TOKEN_SLACK)
        self.unused_images = 0  # rows with images in a text run (said once, by assemble)
        # One int object per token id, shared by every prompt's ids: the tokenizer makes a new one per token (ids past
        # 256 are not cached by Python), several times the list's own bytes when a run holds millions of prompts.
        self.token_ints = list(range(len(tokenizer)))

    def build(self, rows: list[dict]) -> tuple[list[Prompt], PromptStats]:
        """Prompts of rows in a list (PromptRows: their origins name them in errors), Prompt.index the row's."""
        origins = getattr(rows, "origins", None) or [(f"row {i + 1}", None) for i in range(len(rows))]
        return self.assemble(self.outcomes((row, *origin) for row, origin in zip(rows, origins)))

    def outcomes(self, rows: Iterable[tuple[dict, str, Any]]) -> list:
        """Per (row, where, folder): its Prompt (index: its position here), or EMPTY or TOO_LONG."""
        out: list = []
        chunk: list = []
        for item in rows:
            chunk.append(item)
            if len(chunk) == CHUNK_ROWS:
                out += self._chunk(chunk, len(out))
                chunk = []
        return out + self._chunk(chunk, len(out)) if chunk else out

    def assemble(self, outcomes: list) -> tuple[list[Prompt], PromptStats]:
        """The prompts of `outcomes` (each Prompt.index its position there) and the counts; a DataError when no
        prompt is left."""
        prompts = [p if p.index == i else dataclasses.replace(p, index=i) for i, p in _prompts(outcomes)]
        stats = PromptStats(
            total=len(outcomes),
            used=len(prompts),
            skipped_empty=outcomes.count(EMPTY),
            skipped_too_long=outcomes.count(TOO_LONG),
            truncated=sum(p.truncated for p in prompts),
        )
        if self.unused_images:
            logger.warning(
                "%d prompt rows have images in %r (--image_key), which this text run does not use; "
                "--max_images_per_prompt N trains a vision-language model on them",
                self.unused_images,
                self.image_key,
            )
            self.unused_images = 0
        if not prompts:
            also = "" if self.processor is not None else " or use --prompt_overflow truncate"
            raise DataError(f"no prompts left: {stats.summary()}. Raise --prompt_max_len (now {self.max_len}){also}.")
        return prompts, stats

    def _chunk(self, chunk: list, first: int) -> list:
        """The outcomes of rows first, first + 1, ... (each a (row, where, folder))."""
        out: list = [EMPTY] * len(chunk)
        kept = [k for k, (row, _, _) in enumerate(chunk) if not is_empty(row[self.input_key])]
        texts = [self.format(chunk[k][0][self.input_key], first + k) for k in kept]
        if self.processor is not None:
            encoded = [self._image_prompt(chunk[k], text) for k, text in zip(kept, texts)]
        else:
            self.unused_images += sum(1 for row, _, _ in chunk if not is_empty(row.get(self.image_key)))
            encoded = [(ids, None, ()) for ids in self._text_ids(texts)]
        for k, text, (ids, engine_ids, images) in zip(kept, texts, encoded):
            out[k] = self._prompt(chunk[k][0], first + k, text, ids, engine_ids, images)
        return out

    def _prompt(self, row: dict, index: int, text: str, ids: list[int], engine_ids, images) -> Any:
        """The row's Prompt under the length policy, or TOO_LONG."""
        truncated = len(ids) > self.max_len
        if truncated and self.overflow == "skip":
            return TOO_LONG
        if truncated:
            ids = _keep_end(ids, self.max_len, self._head(text))
            text = self.tokenizer.decode(ids)
        label = row[self.label_key] if self.label_key else None
        return Prompt(text, self._shared(ids), label, index, images=images, engine_ids=engine_ids, truncated=truncated)

    def _shared(self, ids: list[int]) -> list[int]:
        """`ids` made of token_ints' objects (a copy, equal)."""
        try:
            return list(map(self.token_ints.__getitem__, ids))
        except IndexError:  # an id past len(tokenizer): kept as it is
            return list(ids)

    def _image_prompt(self, item: tuple, text: str) -> tuple:
        row, where, folder = item
        images = row_images(row, self.image_key, self.max_images, where, folder)
        return (*image_prompt_ids(self.processor, self.tokenizer, text, images, where, self.special), images)

    def _text_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's tokens, short texts in one call; a long one only as far as its length decision needs."""
        short = [t for t in texts if len(t) <= self.window_chars]
        ids = iter(self.tokenizer(short, add_special_tokens=self.special)["input_ids"] if short else [])
        return [next(ids) if len(t) <= self.window_chars else self._window_ids(t) for t in texts]

    def _window_ids(self, text: str) -> list[int]:
        """The tokens of a window of `text` past the limit, else of the whole text (module docstring)."""
        width = self.window_chars
        while width < len(text):
            if self.overflow == "skip":
                cut = text.rfind(" ", width // 2, width)  # between two words where there is a space
                window = text[: cut if cut > 0 else width]
            else:
                cut = text.find(" ", len(text) - width, len(text) - width // 2)  # the space starts the next word
                window = text[cut if cut >= 0 else len(text) - width :]
            ids = self.tokenizer(window, add_special_tokens=self.special)["input_ids"]
            if len(ids) > self.max_len + TOKEN_SLACK:
                return ids
            width *= 4
        return self.tokenizer(text, add_special_tokens=self.special)["input_ids"]

    def _head(self, text: str) -> Optional[int]:
        """The BOS id when the text's tokens start with it (kept by "truncate"), else None."""
        bos = self.tokenizer.bos_token_id
        if bos is None:
            return None
        first = self.tokenizer(text[:64], add_special_tokens=self.special)["input_ids"][:1]
        return bos if first == [bos] else None


def _prompts(outcomes: list):
    return ((i, o) for i, o in enumerate(outcomes) if isinstance(o, Prompt))


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


def _keep_end(ids: list[int], max_len: int, head: Optional[int]) -> list[int]:
    """The last tokens of `ids` within max_len, after `head` (a BOS the text starts with) when there is one."""
    keep = [head] if head is not None and max_len > 1 else []
    return keep + ids[len(ids) - (max_len - len(keep)) :]
