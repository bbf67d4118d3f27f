"""Scalar heads of reward models and critics, read from their folders' files as OpenRLHF writes them, without
loading a model or importing torch (a .bin checkpoint aside): the driver's pre-flight and the workers' load make
the same checks.

    folder/config.json          value_head_prefix? ("score" | "value_head" ...), mean?, std?, normalize_reward?
    folder/*.safetensors|*.bin  "<backbone prefix>.*" (e.g. "model.layers.0...") + "<value_head_prefix>.weight" (1, H)

OpenRLHF's reward model and critic are a backbone plus `nn.Linear(hidden, 1, bias=False)` stored under the
attribute named by --value_head_prefix (default "score", which is also the name of HF's
XForSequenceClassification head; models trained before OpenRLHF 0.5 use "value_head"). A prefix recorded in the
folder's config.json wins over the flag, as in OpenRLHF (its reward-model trainer writes the one it used).

The head is located in the checkpoint files by name (locate_head; workers/value_head.find_head reads it). A head
that is missing or has the wrong shape is a HeadError naming the folder, the prefix, the tensor looked for and
the head-like tensors that are there: transformers would otherwise start a missing head from random numbers
without a word.

Reward statistics (stored_reward_stats): OpenRLHF's reward-model trainer stores the reward mean/std it measured
in config.json ("mean", "std"); with --normalize_reward OpenRLHF's reward model returns (r - mean) / std (at
inference), and its critic (v - mean) / std (always, training included). The flag decides, not the config's own
"normalize_reward" key (OpenRLHF overwrites that key with the flag). Without "mean" the statistics are (0, 1).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

from orlhf.inputs.model_files import safetensors_header

log = logging.getLogger(__name__)

# Architectures written by OpenRLHF's reward-model / critic classes and by HF's sequence classifiers: a folder
# with one of these holds a trained head, so a missing head is an error even for the critic.
_HEAD_ARCHS = ("RewardModel", "CriticModel", "ForSequenceClassification")
_MAX_HEAD_ROWS = 16  # a (n, H) tensor outside the backbone with n <= 16 looks like a classification head


class HeadError(ValueError):
    """A reward model or critic folder whose value head cannot be used; the message names folder and tensor."""


def read_config(folder: str) -> dict:
    path = Path(folder).expanduser() / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no local config (a hub id): transformers reports it when it loads the model


def resolve_prefix(folder: str, flag_prefix: str) -> str:
    """The head's name: config.json's value_head_prefix if recorded (as OpenRLHF), else --value_head_prefix."""
    recorded = read_config(folder).get("value_head_prefix")
    if isinstance(recorded, str) and recorded and recorded != flag_prefix:
        log.warning(
            "%s: config.json records value_head_prefix=%r; using it instead of --value_head_prefix %r "
            "(as OpenRLHF does)",
            folder,
            recorded,
            flag_prefix,
        )
        return recorded
    return flag_prefix


def stored_reward_stats(folder: str) -> Optional[tuple[float, float]]:
    """(mean, std) from config.json as OpenRLHF's reward-model trainer stores them, or None if it stores none.

    Raises HeadError for a "mean" without a usable "std" (OpenRLHF would crash or divide by zero).
    """
    cfg = read_config(folder)
    if "mean" not in cfg:
        return None
    mean, std = _number(cfg.get("mean")), _number(cfg.get("std"))
    if mean is None or std is None or not std > 0:
        raise HeadError(
            f"{folder}/config.json: reward statistics mean={cfg.get('mean')!r}, std={cfg.get('std')!r}; "
            "both must be finite numbers with std > 0 (fix them, or delete both keys to use the raw "
            "reward)."
        )
    return mean, std


def _number(value) -> Optional[float]:
    if isinstance(value, list) and len(value) == 1:  # a 1-element tensor saved with .tolist()
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


# ---- reading tensors by name from a checkpoint folder ----


def checkpoint_files(folder: str) -> list[Path]:
    """The weight files of an HF folder: *.safetensors (preferred, as transformers) else pytorch_model*.bin."""
    root = Path(folder).expanduser()
    for pattern in ("*.safetensors", "pytorch_model*.bin"):
        files = sorted(root.glob(pattern))
        if files:
            return files
    return []


def tensor_shapes(folder: str) -> dict[str, tuple[tuple[int, ...], Path]]:
    """name -> (shape, file) for every tensor in the folder's weight files, without loading the tensors (a
    safetensors file's JSON header; a .bin file through torch.load with mmap)."""
    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in checkpoint_files(folder):
        try:
            if f.suffix == ".safetensors":
                out.update({name: (shape, f) for name, shape in _safetensors_shapes(f).items()})
            else:
                import torch

                state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                out.update({name: (tuple(t.shape), f) for name, t in state.items()})
        except Exception as e:  # a truncated or corrupt file: name it, before anything starts
            raise HeadError(
                f"{f}: cannot read the model's weights ({type(e).__name__}: {e}); re-save or re-download "
                "the model folder."
            ) from e
    return out


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(entry["shape"]) for name, entry in safetensors_header(path).items()}


# ---- the head ----


def head_like(shapes: dict, backbone_prefix: str, hidden: int) -> list[str]:
    """Tensors that look like a scalar/classification head: outside the backbone, not the LM head, and either
    named like a head or shaped (n <= 16, hidden)."""
    out = []
    for name, (shape, _) in shapes.items():
        if name.startswith(f"{backbone_prefix}.") or name.startswith("lm_head."):
            continue
        shaped = len(shape) == 2 and shape[1] == hidden and shape[0] <= _MAX_HEAD_ROWS
        if shaped or "head" in name or "score" in name:
            out.append(f"{name} {list(shape)}")
    return sorted(out)


def locate_head(
    folder: str, prefix: str, hidden: int, backbone_prefix: str, required: bool, shapes: Optional[dict] = None
) -> Optional[tuple[Path, Optional[Path]]]:
    """Where "<prefix>.weight" (1, hidden) is: (weight file, bias file or None), after checking its shape.

    Missing: HeadError if `required`, or if the folder holds another head-like tensor, or its config says it is a
    reward/critic model; None otherwise (a plain causal LM or base model: the caller starts a fresh head).
    `shapes`: tensor_shapes(folder), where the caller has read them already.
    """
    shapes = tensor_shapes(folder) if shapes is None else shapes
    want = f"{prefix}.weight"
    found = head_like(shapes, backbone_prefix, hidden)
    seen = f"head-like tensors there: {', '.join(found[:10])}" if found else "no head-like tensor there"
    if want not in shapes:
        archs = read_config(folder).get("architectures") or []
        trained = [a for a in archs if a.endswith(_HEAD_ARCHS)]
        if required or found or trained:
            what = (
                f"its config.json says {trained[0]}"
                if trained
                else "a reward model needs one"
                if required
                else "it holds another head"
            )
            raise HeadError(
                f"{folder}: no value head {want!r} for --value_head_prefix {prefix} ({what}); {seen}. "
                f"{_prefix_hint(found)}"
            )
        return None
    shape, path = shapes[want]
    if shape != (1, hidden):
        raise HeadError(
            f"{folder}: value head {want!r} has shape {list(shape)}; a reward/critic head is [1, {hidden}] "
            "(one score per token; a classifier with several labels cannot score). "
            f"Pick the scalar head with --value_head_prefix ({seen})."
        )
    bias = shapes.get(f"{prefix}.bias")
    if bias is not None and bias[0] != (1,):
        raise HeadError(f"{folder}: {prefix}.bias has shape {list(bias[0])}; a reward/critic head's bias is [1].")
    return path, bias[1] if bias is not None else None


def check_head(folder: str, flag_prefix: str, required: bool) -> None:
    """Driver-side pre-flight, before Ray starts: the checks the worker's load makes, from the folder's files
    alone (config.json, tensor names and shapes), so a wrong head fails in a second, not after start-up.

    No torch or transformers: AutoConfig's import alone pulls transformers' type validators and, through them,
    torch's compiler and DTensor modules, on the driver's main thread before Ray starts. The hidden size comes
    from config.json and the backbone's prefix from the tensor names (backbone_prefix_of); where either cannot be
    read, the worker's load makes the check with the real config."""
    hidden = config_hidden_size(read_config(folder))
    if hidden is None:
        return
    shapes = tensor_shapes(folder)
    locate_head(
        folder, resolve_prefix(folder, flag_prefix), hidden, backbone_prefix_of(shapes), required, shapes=shapes
    )
    stored_reward_stats(folder)


def config_hidden_size(config: dict) -> Optional[int]:
    """The model width as config.json records it (the names transformers' configs map to hidden_size), or None."""
    for cfg in (config, config.get("text_config") or {}):
        for key in ("hidden_size", "n_embd", "d_model", "dim"):
            value = cfg.get(key) if isinstance(cfg, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def backbone_prefix_of(shapes: dict) -> str:
    """The first name component most tensors share ("model" in "model.layers.0.mlp.up_proj.weight"): the backbone
    attribute of the checkpoint's model class (its base_model_prefix), read from the names alone."""
    counts: dict[str, int] = {}
    for name in shapes:
        head, dot, _ = name.partition(".")
        if dot and head != "lm_head":
            counts[head] = counts.get(head, 0) + 1
    return max(counts, key=counts.get) if counts else "model"


def _prefix_hint(found: list[str]) -> str:
    names = [f.split(" ")[0] for f in found]
    prefixes = [n[: -len(".weight")] for n in names if n.endswith(".weight") and "." not in n[: -len(".weight")]]
    if prefixes:
        return f"Pass --value_head_prefix {prefixes[0]} if that is the head."
    return (
        "Point the flag at a reward model (OpenRLHF's or HF's XForSequenceClassification with num_labels=1), "
        "or set --value_head_prefix to its head's name."
    )


def reward_normalization(normalize_reward: bool, reward_pretrain: Optional[str]) -> str:
    """How --normalize_reward applies: "off"; "stored" (the reward model divides by the mean/std in its
    config.json, as OpenRLHF); "running" (orlhf's running statistics of this run's rewards, for reward sources
    that store none: functions, URLs, reward models without mean/std). Never both: one normalization."""
    if not normalize_reward:
        return "off"
    if reward_pretrain is not None and stored_reward_stats(reward_pretrain) is not None:
        return "stored"
    return "running"
