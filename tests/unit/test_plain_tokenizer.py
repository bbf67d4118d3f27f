"""inputs/tokenizer.py's _plain_tokenizer: the driver's tokenizer without importing AutoTokenizer's module, only
where AutoTokenizer itself returns the same class from the same call, checked against transformers' own tables and by
loading both."""

import filecmp
import json
import shutil
import subprocess
import sys

import pytest

from orlhf.demo.builder import ensure_demo
from orlhf.inputs.tokenizer import PLAIN_TOKENIZER_TYPES, _plain_tokenizer, load_tokenizer


def demo_copy(tmp_path, **config_changes):
    """The demo's model folder (tokenizer saved as TokenizersBackend, model_type llama), config.json changed."""
    folder = tmp_path / "model"
    shutil.copytree(ensure_demo().model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config_changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_the_listed_types_are_ones_autotokenizer_does_not_override():
    """AutoTokenizer returns the saved TokenizersBackend unless the model type is one whose hub class it
    distrusts or Mistral's; a transformers upgrade that changes this fails here."""
    from transformers.models.auto import tokenization_auto as ta
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    for model_type in PLAIN_TOKENIZER_TYPES:
        assert model_type not in ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert ta.TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"
    assert ta.tokenizer_class_from_name("TokenizersBackend") is TokenizersBackend


def test_the_demo_loads_the_same_tokenizer_as_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    path = str(ensure_demo().model)
    fast, auto = _plain_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert fast is not None and type(fast) is type(auto)
    assert fast.init_kwargs == auto.init_kwargs and fast.name_or_path == auto.name_or_path
    assert fast.get_vocab() == auto.get_vocab() and fast.all_special_tokens == auto.all_special_tokens
    texts = ["Hello world", "  spaces\tand\nnewlines ", "ünïcödé 123 <s> </s>", ""]
    assert [fast.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    assert fast.chat_template == auto.chat_template
    fast.save_pretrained(tmp_path / "fast")
    auto.save_pretrained(tmp_path / "auto")
    files = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert sorted(p.name for p in (tmp_path / "fast").iterdir()) == files
    assert filecmp.cmpfiles(tmp_path / "fast", tmp_path / "auto", files, shallow=False)[0] == files


@pytest.mark.parametrize(
    "change",
    [{"model_type": "qwen2"}, {"auto_map": {"AutoConfig": "x.Y"}}, {"model_name": "something"}],
    ids=["other_type", "auto_map", "model_name"],
)
def test_anything_else_goes_through_autotokenizer(tmp_path, change):
    assert _plain_tokenizer(str(demo_copy(tmp_path, **change))) is None
    assert _plain_tokenizer(str(tmp_path / "missing")) is None


def test_the_driver_does_not_import_autotokenizers_module():
    code = (
        "import sys; from orlhf.inputs.tokenizer import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print('transformers.models.auto.tokenization_auto' in sys.modules, 'sympy' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ensure_demo().model)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False"]


def test_load_tokenizer_still_pads_left_on_the_plain_path():
    tok = load_tokenizer(str(ensure_demo().model))
    assert tok.padding_side == "left" and tok.pad_token is not None
