"""Images of vision-language prompts (--max_images_per_prompt > 0): a row's images, the model's processor.

    row[--image_key] --row_images()--> tuple[bytes]        encoded image files, each checked to open, at most
                                                           --max_images_per_prompt (prompts.build_prompts)
        a path (absolute; a relative one is read from the working directory, then from the data file's folder),
        bytes, {"bytes": ..., "path": ...} (datasets' Image feature, as parquet stores it), a data:image/...;base64,
        URI; one value or a list; missing, None or [] (or only Nones): a text row
    --open_images()--> list[PIL.Image] (RGB)
    --processor--> the expanded prompt ids (build_prompts), the image tensors (prompt_vision: each step, in the
                   driver, for the trainers' forwards)

Images travel as encoded bytes, not paths: the engines and the driver may run on other machines than the files,
and bytes keep a Prompt self-contained and the same for every process that decodes it.
image_token_ids() are the ids no response may contain: an HF vision-language forward replaces every image-token id
with image features and fails when their count differs from the images'.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any, Optional

from orlhf.inputs.errors import DataError

# Keys of a processor's output that are not image tensors: the prompt's tokens and what is built from them (a
# forward rebuilds them for the whole sequence, prompt and response).
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
_DUMMY_SIZE = 64  # pixels a side of the image image_token_ids() expands: small, resized up by any processor


def row_images(
    row: dict, image_key: str, max_images: int, where: str, data_dir: Optional[Path] = None
) -> tuple[bytes, ...]:
    """The row's images (field `image_key`) as encoded files, in order; () for a text row. `where` names the row in
    messages ("data.jsonl line 3"); `data_dir`: the data file's folder, where relative paths are also looked up."""
    value = row.get(image_key)
    values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
    if len(values) > max_images:
        raise DataError(
            f"{where}: {len(values)} images in {image_key!r} (--image_key), more than --max_images_per_prompt "
            f"{max_images}; raise --max_images_per_prompt or drop images from that row."
        )
    out = []
    for i, v in enumerate(values):
        what = f"{where}: image {i + 1} in {image_key!r} (--image_key)"
        data = _encoded(v, what, data_dir)
        _check_opens(data, what)
        out.append(data)
    return tuple(out)


def _encoded(value: Any, what: str, data_dir: Optional[Path]) -> bytes:
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # datasets' Image feature
        value = value.get("bytes") or value.get("path")
        if value is None:
            raise DataError(f"{what} has neither bytes nor a path; fix or remove that row.")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str):
        raise DataError(
            f"{what} is a {type(value).__name__}; give a file path, encoded image bytes, or a "
            "data:image/...;base64, URI."
        )
    if value.startswith(("http://", "https://")):
        raise DataError(
            f"{what} is a URL ({_short(value)}): orlhf does not download images: download them and give paths."
        )
    if value.startswith("data:"):
        head, _, payload = value.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise DataError(f"{what}: a data URI that is not data:image/...;base64,... ({_short(value)}).")
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as e:
            raise DataError(f"{what}: its data URI is not valid base64 ({e}); fix or remove that row.") from None
    path = Path(value).expanduser()
    folders = [] if path.is_absolute() else [Path.cwd()] + ([Path(data_dir)] if data_dir is not None else [])
    found = next((f / path for f in folders if (f / path).is_file()), None) if folders else path
    if found is None or not found.is_file():
        looked = f" (looked in {' and '.join(map(str, folders))})" if folders else ""
        raise DataError(f"{what}: no such file {_short(value)}{looked}; fix the path or the row.")
    return found.read_bytes()


def _check_opens(data: bytes, what: str) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # reads the whole file: a truncated or corrupt one fails here, not in a later step
    except Exception as e:  # noqa: BLE001 - PIL raises many types (UnidentifiedImageError, OSError, SyntaxError)
        raise DataError(
            f"{what} is not an image PIL can open ({type(e).__name__}: {e}); fix or remove that row."
        ) from None


def _short(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[:n] + "..."


def open_images(images: tuple[bytes, ...]) -> list:
    """Encoded image files -> PIL images in RGB (processors take RGB; a PNG may be RGBA, paletted or gray)."""
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]


# ---- The model's processor ----


def load_processor(path: str):
    """The --pretrain folder's processor (AutoProcessor, loaded as the tokenizer is), which must take images."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
    except Exception as e:  # OSError, ValueError, JSON errors...: all mean "no usable processor there"
        raise DataError(
            f"--pretrain {path}: cannot load its processor ({type(e).__name__}: {e}); --max_images_per_prompt > 0 "
            "needs a vision-language model folder saved with its processor (processor.save_pretrained(DIR))."
        ) from e
    if getattr(processor, "image_processor", None) is None:
        raise DataError(
            f"--pretrain {path}: its processor ({type(processor).__name__}) takes no images; --max_images_per_prompt "
            "> 0 needs a vision-language model folder saved with its processor (processor.save_pretrained(DIR))."
        )
    return processor


def image_token(processor) -> tuple[str, int]:
    """(the processor's image placeholder, its id): what a prompt holds once per image before expansion."""
    token = getattr(processor, "image_token", None)
    token_id = getattr(processor, "image_token_id", None)
    if token is not None and token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(str(token))
    if token is None or not isinstance(token_id, int):
        raise DataError(
            f"the processor {type(processor).__name__} names no image token (image_token / image_token_id); "
            "orlhf needs one to place images in a prompt."
        )
    return str(token), token_id


def image_prompt_ids(
    processor, tokenizer, text: str, images: tuple[bytes, ...], where: str, add_special_tokens: bool
) -> tuple[list[int], Optional[list[int]]]:
    """(ids, engine_ids) of a prompt of a vision-language run: engine_ids are the text's tokens (one placeholder per
    image; what vLLM expands itself), ids the processor's (each placeholder expanded: what the trainers score).
    A text prompt: (its tokens, None). The placeholders must match the images one for one."""
    engine_ids = [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
    token, token_id = image_token(processor)
    found = engine_ids.count(token_id)
    if found != len(images):
        raise DataError(
            f"{where}: the prompt holds {found} image placeholder(s) ({token}) for {len(images)} image(s) in the "
            'row; put one image item ({"type": "image"}) in the message content per image with '
            f"--apply_chat_template (or write {token} in the prompt text where each image goes), and give the row "
            "as many images."
        )
    if not images:
        return engine_ids, None
    out = processor(text=[text], images=open_images(images), add_special_tokens=add_special_tokens)
    return [int(t) for t in out["input_ids"][0]], engine_ids


def prompt_vision(processor, prompt) -> Optional[dict]:
    """The processor's image tensors (pixel_values, and what the family adds) for a Prompt's images, as a forward
    takes them; None for a text prompt."""
    if not prompt.images:
        return None
    out = processor(
        text=[prompt.text], images=open_images(prompt.images), add_special_tokens=False, return_tensors="pt"
    )
    return {k: v for k, v in out.items() if k not in TEXT_KEYS}


def image_token_ids(processor, tokenizer) -> list[int]:
    """The ids a response must never contain: the image token, and every id the processor's expansion of one
    (dummy) image adds that the plain tokenization of its placeholder does not (the tags around an image)."""
    from PIL import Image

    token, token_id = image_token(processor)
    dummy = Image.new("RGB", (_DUMMY_SIZE, _DUMMY_SIZE), (128, 128, 128))
    expanded = processor(text=[token], images=[dummy], add_special_tokens=False)["input_ids"][0]
    plain = tokenizer(token, add_special_tokens=False)["input_ids"]
    added = {int(t) for t in expanded} - {int(t) for t in plain}
    return sorted(added | {token_id})
