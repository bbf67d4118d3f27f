"""The actor's tokenizer: left-padded (prompts end where generation starts), with a pad token.

A local folder that AutoTokenizer would load as TokenizersBackend is loaded as that class directly, without importing
AutoTokenizer's module (its model-class tables pull in torch.distributed's tensor, sympy and torch._dynamo), which
is a large part of the driver's start-up before the first step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from orlhf.inputs.errors import DataError

logger = logging.getLogger(__name__)

# Model types whose local folder saved with tokenizer_class "TokenizersBackend" AutoTokenizer loads as that class,
# with nothing else to decide (transformers 5: not a type it overrides the saved class for, nor Mistral's format);
# tests/unit/test_plain_tokenizer.py checks this against transformers' own tables and loads.
PLAIN_TOKENIZER_TYPES = ("llama",)


def _plain_tokenizer(path: str):
    """AutoTokenizer's own result for a local folder it would load as TokenizersBackend (PLAIN_TOKENIZER_TYPES),
    loaded without importing AutoTokenizer's module (see the module docstring). None: use AutoTokenizer (any other
    folder, a hub name, unreadable files: its own errors then)."""
    folder = Path(path)
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        model_cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(tok_cfg, dict) and isinstance(model_cfg, dict) and folder.is_dir()):
        return None
    if (
        tok_cfg.get("tokenizer_class") != "TokenizersBackend"
        or "auto_map" in tok_cfg
        or "auto_map" in model_cfg
        or model_cfg.get("model_type") not in PLAIN_TOKENIZER_TYPES
        or "model_name" in model_cfg
    ):
        return None
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend.from_pretrained(path, _from_auto=True, revision=None)  # AutoTokenizer's call


def load_tokenizer(path: str):
    """The actor's tokenizer, left-padded (prompts end where generation starts), with a pad token."""
    try:
        tok = _plain_tokenizer(path)
        if tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # OSError, ValueError, JSON errors...: all mean "not a usable tokenizer folder"
        raise DataError(
            f"--pretrain {path}: cannot load its tokenizer ({type(e).__name__}: {e}); point --pretrain "
            "at a HF model folder with tokenizer files (tokenizer.json or tokenizer_config.json)."
        ) from e
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise DataError(
                f"--pretrain {path}: the tokenizer has neither a pad nor an eos token; add a pad_token "
                "to its tokenizer_config.json."
            )
        tok.pad_token = tok.eos_token
        logger.info("tokenizer of %s has no pad token; using eos %r as pad", path, tok.eos_token)
    return tok
