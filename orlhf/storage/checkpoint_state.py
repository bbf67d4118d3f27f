"""What a checkpoint's files hold, read and written without unpickling code: the driver's and each rank's state
(RNG included) as JSON + safetensors, and DeepSpeed's own files loaded with torch.load(weights_only=True).

The folder around these files (atomic commit, rotation, resume lookup) is storage/checkpoint.py's; the state
encoding itself is storage/checkpoint_format.py's (pure).
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any

from orlhf.storage.checkpoint_format import CheckpointError, decode_state, encode_state

log = logging.getLogger(__name__)


# ---- driver state and RNG -------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python `random`, numpy's global generator, torch CPU, and CUDA if in use."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never initialise CUDA just to read it
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning(
                "checkpoint has CUDA RNG states of %d devices, this process sees %d: not restored",
                len(state["cuda"]),
                torch.cuda.device_count(),
            )


def save_state(folder: str | os.PathLike, name: str, state: dict[str, Any]) -> None:
    """Write `state` as <name>.json, its tensors (any depth) in <name>.safetensors. Tuples come back as tuples.
    Dict keys must be strings; leaves: None, bool, int, float, str, torch.Tensor."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}  # torch tensors
    doc = encode_state(state, tensors)
    folder = Path(folder)
    if tensors:
        save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(doc, indent=1))


def load_state(folder: str | os.PathLike, name: str) -> dict[str, Any]:
    """Read what save_state wrote (JSON + safetensors: no pickle)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        doc = json.loads((folder / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot read {name}.json ({e})") from e
    blob = folder / f"{name}.safetensors"
    tensors = load_file(str(blob)) if blob.exists() else {}
    return decode_state(doc, tensors)


def save_controller_state(folder: str | os.PathLike, state: dict[str, Any]) -> None:
    """The driver's state (include "rng": rng_state()) into a checkpoint folder: controller.json (+ tensors)."""
    save_state(folder, "controller", state)


def load_controller_state(folder: str | os.PathLike) -> dict[str, Any]:
    return load_state(folder, "controller")


# ---- DeepSpeed's files, loaded without unpickling code --------------------------------------------------------


def deepspeed_safe_globals() -> list:
    """The non-torch classes in DeepSpeed 0.19.8's checkpoint files for orlhf's configs (ZeRO 0/1/2/3, bf16, Adam
    offload), as torch.serialization.get_unsafe_globals_in_checkpoint lists them: an enum and two plain
    data holders (no code runs when they are rebuilt). Allowed for loads of those files only."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def safe_torch_load(path: str | os.PathLike, map_location=None, mmap: bool = False, load=None) -> Any:
    """torch.load(weights_only=True) with DeepSpeed's state classes allowed for this call only. mmap: tensors are
    mapped from the file, not read (to look at a big file's plain values). load: the torch.load to call (where
    torch.load itself is replaced, workers/universal_ckpt.py)."""
    import torch

    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return (load or torch.load)(path, map_location=map_location, weights_only=True, mmap=mmap)
