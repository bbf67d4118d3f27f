"""benchmarks/model_presets.py's large-vocabulary tokenizer (what probes/bench_large_vocab_run.py trains on): the demo's
tokenizer grown with filler words to any vocabulary size encodes the demo's text exactly as before, and every id a
model could sample decodes to text."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import model_presets as mp  # noqa: E402


def test_grown_tokenizer_keeps_the_demo_encoding_and_decodes_every_id(tmp_path):
    from transformers import AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    demo = AutoTokenizer.from_pretrained(ensure_demo().model)
    tok = mp.filler_tokenizer(tmp_path / "tok", 3000)
    assert len(tok) == 3000
    text = "user: say colors: red blue cat run\nassistant: green"
    assert tok(text)["input_ids"] == demo(text)["input_ids"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (
        demo.pad_token_id,
        demo.eos_token_id,
        demo.bos_token_id,
    )
    new = [len(demo), 2000, 2999]  # filler ids: one word each, no color
    assert tok.decode(new) == f" <filler{new[0]}> <filler2000> <filler2999>"
    assert tok.decode(demo("red blue")["input_ids"] + new[:1]) == f"red blue <filler{new[0]}>"
