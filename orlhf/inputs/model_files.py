"""What a run reads from a model folder, checked from its files alone before Ray starts (no torch, no transformers):

    config.json                     the longest sequence its positions allow (max_positions), derived as vLLM
                                    derives an engine's max_model_len limit; which mixture-of-experts family it is
                                    (REPLAYED_MOE_FAMILIES)
    *.safetensors                   each header fits its file and the tensors end inside it (weight_file_problem)
    model.safetensors.index.json    every shard it names is there and holds the tensors it puts there

A sequence longer than the model's positions kills vLLM's engine in its init, and a truncated or missing shard
fails inside a rank or an engine; both only after the whole start-up, in a library's traceback that names neither
the flag nor the file. Reading config.json and the headers takes milliseconds; the tensors are never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

# config.json keys that bound a model's positions, in vLLM's order (ModelArchConfigConvertor
# .derive_max_model_len_and_key): the smallest one present is the limit, except model_max_length, which wins.
POSITION_KEYS = (
    "max_position_embeddings",  # Llama, Qwen, Mistral, OPT, ...
    "n_positions",  # GPT-2
    "max_seq_len",  # MPT
    "seq_length",  # ChatGLM
    "model_max_length",  # Command-R
    "max_target_positions",  # Whisper
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length: vLLM applies no `factor` to them.
SCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
INDEX_NAME = "model.safetensors.index.json"

# Mixture-of-experts families whose routing --router_replay records and replays (workers/router_replay.py): their
# config.json model_type -> how their router weighs the experts it picks: the softmax over all experts taken at the
# chosen ones, renormalized over them "always" (Mixtral) or as the config's "norm_topk_prob" says (the Qwen MoEs).
REPLAYED_MOE_FAMILIES = {"mixtral": "always", "qwen2_moe": "norm_topk_prob", "qwen3_moe": "norm_topk_prob"}


def read_config(folder: str) -> Optional[dict]:
    """The folder's config.json, or None where there is none to read (a hub id; validation names a missing one)."""
    try:
        config = json.loads((Path(folder).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def max_positions(config: dict) -> Optional[tuple[int, str]]:
    """(the longest sequence an engine may serve, the config.json key it comes from), as vLLM derives it from the
    text config: the smallest of POSITION_KEYS (model_max_length wins when given), times the RoPE scaling factor
    unless the RoPE type scales max_position_embeddings itself (or the model is a Gemma 3). None: no such key
    (vLLM then takes the length it is asked for)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = {key: text[key] for key in POSITION_KEYS if _positive_int(text.get(key))}
    if not found:
        return None
    key = "model_max_length" if "model_max_length" in found else min(found, key=found.__getitem__)
    factor = 1.0
    if "gemma3" not in str(config.get("model_type", "")):
        for rope in _rope_parameters(text):
            if rope.get("rope_type", rope.get("type")) not in SCALED_ROPE_TYPES:
                f = rope.get("factor", factor)
                factor = float(f) if isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 else 1.0
    return int(found[key] * factor), key


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rope_parameters(config: dict) -> list[dict]:
    """config.json's RoPE settings ("rope_parameters", or the older "rope_scaling"): one dict, or one per layer
    type when nested ({"full_attention": {...}, "sliding_attention": {...}})."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict):
        return []
    nested = rope and "rope_type" not in rope and "type" not in rope and all(isinstance(v, dict) for v in rope.values())
    return [v for v in rope.values() if v] if nested else [rope]


def weight_file_problem(folder: str) -> Optional[str]:
    """What is wrong with the folder's safetensors files (a truncated or unreadable file, a shard its index names
    that is missing, or that lacks a tensor the index puts there), naming the file; None when all are whole."""
    root = Path(folder).expanduser()
    files = sorted(root.glob("*.safetensors"))
    headers: dict[str, dict] = {}
    for path in files:
        try:
            headers[path.name] = safetensors_header(path)
        except (OSError, ValueError) as e:
            return f"{path} is unreadable or truncated ({e})"
    index = root / INDEX_NAME
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("'weight_map' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{index} is unreadable ({type(e).__name__}: {e})"
    for name, shard in sorted(weight_map.items(), key=lambda item: str(item[1])):
        if str(shard) not in headers:
            return f"{root / str(shard)}, named by {INDEX_NAME}, is missing"
        if name not in headers[str(shard)]:
            return f"{root / str(shard)} has no tensor {name!r}, which {INDEX_NAME} puts there"
    return None


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file, {name: {"dtype", "shape", "data_offsets"}}, from its header alone:
    an 8-byte little-endian header length, the JSON header, then the data. ValueError when the header does not
    fit the file or the tensors end past it (a truncated download or copy)."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= total - 8:
            raise ValueError(f"header length {size} does not fit the file's {total} bytes")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("the header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    try:
        end = max((int(entry["data_offsets"][1]) for entry in tensors.values()), default=0)
    except (KeyError, IndexError, TypeError, ValueError):
        raise ValueError("a tensor entry has no data_offsets") from None
    if end > total - 8 - size:
        raise ValueError(f"its tensors end at byte {8 + size + end}, past the file's {total} bytes")
    return tensors
