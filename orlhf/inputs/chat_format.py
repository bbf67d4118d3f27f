"""A row's prompt value -> the prompt string (inputs/prompts.py's PromptBuilder calls it): the chat template over a
conversation, --input_template over a text, or the text as it is.

A conversation is a list of {"role": str, "content": str}; in a vision-language run (--max_images_per_prompt > 0) a
content may also be a list of parts, {"type": "text", "text": str} and {"type": "image"}, which the model's chat
template turns into its image placeholder. Anything else is refused here, naming the row, where it
would fail inside the template's Jinja, unreadably.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from orlhf.inputs.errors import DataError


@dataclass(frozen=True)
class PromptFormat:
    """A row's prompt value -> the prompt string: the chat template (of `templater`), --input_template, or as is."""

    key: str  # --input_key
    templater: Any  # what applies the chat template: the tokenizer, or a vision-language model's processor
    apply_chat_template: bool
    input_template: Optional[str]
    vision: bool  # a vision-language run: messages may hold image items

    def __call__(self, value: Any, index: int) -> str:
        if self.apply_chat_template:
            # A row may hold a whole conversation ([{"role", "content"}, ...]), as OpenRLHF allows.
            messages = value if isinstance(value, list) else [{"role": "user", "content": str(value)}]
            check_messages(messages, index, self.key, self.vision)
            if self.vision:  # OpenRLHF's "<image>" in a text content is an image item of the template
                messages = [{**m, "content": content_list(m["content"])} for m in messages]
            try:
                return self.templater.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # jinja2 errors of the model's own template: name the row, not the template line
                raise DataError(
                    f"row {index + 1}: the chat template failed on this conversation "
                    f"({type(e).__name__}: {e}); check its roles and contents."
                ) from None
        if not isinstance(value, str):
            raise DataError(
                f"row {index + 1}: the prompt ({self.key!r}, --input_key) is a list of chat messages, which "
                "needs --apply_chat_template."
            )
        return self.input_template.format(value) if self.input_template else value


def content_list(content: Any) -> Any:
    """OpenRLHF's reading of a text content with "<image>" tags: "<image>Find x." -> [{"type": "image"},
    {"type": "text", "text": "Find x."}]; any other content as it is."""
    if not isinstance(content, str) or "<image>" not in content:
        return content
    parts: list[dict] = []
    for j, text in enumerate(content.split("<image>")):
        if j:
            parts.append({"type": "image"})
        if text.strip():
            parts.append({"type": "text", "text": text.strip()})
    return parts


def check_messages(messages: list, index: int, key: str, images: bool = False) -> None:
    """A conversation is a list of {"role": str, "content": str}, or in a vision-language run (`images`) a content
    that is a list of parts, {"type": "text", "text": str} or {"type": "image"}; anything else fails inside Jinja,
    unreadably."""
    for j, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, (str, list)):
            got = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise DataError(
                f"row {index + 1}: message {j + 1} of the conversation in {key!r} (--input_key) needs "
                f'a "role" string and a "content" string (or list of parts), got {got}; fix that row, e.g. '
                '{"role": "user", "content": "..."}.'
            )
        if isinstance(content, list) and not images:
            # A text model's template may print a list as it is (its repr in the prompt): refused, not guessed.
            raise DataError(
                f"row {index + 1}: message {j + 1} of {key!r} (--input_key) has a list of content parts, which are "
                "read in vision-language runs only (--max_images_per_prompt N > 0); in a text run write the "
                "content as a string."
            )
        for k, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" or (kind == "text" and isinstance(part.get("text"), str)):
                continue
            raise DataError(
                f"row {index + 1}: part {k + 1} of message {j + 1} of {key!r} (--input_key) is {part!r:.80}; "
                'content parts are {"type": "text", "text": "..."} or {"type": "image"}.'
            )
