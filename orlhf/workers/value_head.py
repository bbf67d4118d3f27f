"""The value head a reward model's or critic's worker loads: located by orlhf.inputs.head_files (where the folder format
and the checks are described), read as a float32 nn.Linear(hidden, 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from orlhf.inputs.head_files import locate_head


def _read_tensor(path: Path, name: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as st:
            return st.get_tensor(name)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[name].clone()


def find_head(folder: str, prefix: str, hidden: int, backbone_prefix: str, required: bool) -> Optional[nn.Linear]:
    """The head located by locate_head as a float32 nn.Linear(hidden, 1), or None (see locate_head)."""
    where = locate_head(folder, prefix, hidden, backbone_prefix, required)
    if where is None:
        return None
    weight_file, bias_file = where
    head = nn.Linear(hidden, 1, bias=bias_file is not None)
    with torch.no_grad():
        head.weight.copy_(_read_tensor(weight_file, f"{prefix}.weight").float())
        if bias_file is not None:
            head.bias.copy_(_read_tensor(bias_file, f"{prefix}.bias").float())
    return head
