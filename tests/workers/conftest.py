from pathlib import Path

import pytest
from mp_tools import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A folder holding lm/: a 1-layer Llama with a 64-token vocabulary (the multi-process loss tests' model)."""
    root = tmp_path_factory.mktemp("lm")
    save_tiny_llama(root, 64)
    return root
