"""Big prompt files: rows read one at a time, over-long prompts decided from a window of their text (never tokenized
whole), the same prompts and counts as tokenizing every text whole, and a progress bar once reading is slow
(inputs/prompt_rows.py, inputs/prompts.py). benchmarks/probes/bench_prompt_read.py measures time and memory."""

import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import orlhf.inputs.prompt_rows as prompt_rows
from orlhf.demo.builder import ensure_demo
from orlhf.inputs.errors import DataError
from orlhf.inputs.prompt_mix import read_prompts
from orlhf.inputs.prompt_rows import iter_prompt_rows
from orlhf.inputs.prompts import PromptBuilder, _keep_end
from orlhf.inputs.tokenizer import load_tokenizer

MAX_LEN = 16  # window_chars = 8 x (16 + 32) = 384 characters


class Counting:
    """A tokenizer that records the longest text it was given."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max([self.longest] + [len(t) for t in ([text] if isinstance(text, str) else text)])
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ensure_demo().model))


@pytest.fixture(scope="module")
def unigram():
    """A SentencePiece-style tokenizer (Metaspace + Unigram: words are not split apart first) with a BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    corpus = [" ".join(random.Random(i).choice(WORDS) for _ in range(40)) for i in range(200)]
    t.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=200, special_tokens=["<s>", "<unk>"]))
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", unk_token="<unk>", pad_token="<unk>")


WORDS = ["red", "green", "blue", "colors", "say", "the", "sky", "is", "a", "tomato", "1234567", "x" * 30]


def texts(seed: int) -> list[str]:
    """Texts from far below to far above the limit, some with long runs without a space (cut mid-word)."""
    rng = random.Random(seed)
    out = []
    for n in (1, 5, 10, 14, 16, 17, 20, 40, 100, 300, 1000, 3000):
        words = [rng.choice(WORDS) for _ in range(n)]
        if n > 50:
            words.insert(rng.randrange(n), "y" * rng.choice([50, 400, 2000]))
        out.append(" ".join(words))
    return out


def whole(tok, text: str, overflow: str, special: bool = True):
    """What the policy gives when the text is tokenized whole: (text, ids), or None when skipped."""
    ids = tok(text, add_special_tokens=special)["input_ids"]
    if len(ids) <= MAX_LEN:
        return text, ids
    if overflow == "skip":
        return None
    head = tok.bos_token_id if ids[0] == tok.bos_token_id else None
    kept = _keep_end(ids, MAX_LEN, head)
    return tok.decode(kept), kept


@pytest.mark.parametrize("overflow", ["skip", "truncate"])
@pytest.mark.parametrize("which", ["tok", "unigram"])
def test_windows_give_the_prompts_whole_texts_give_and_never_tokenize_a_long_text_whole(
    request, which, overflow, tmp_path
):
    tokenizer = request.getfixturevalue(which)
    rows = [{"q": t} for seed in range(4) for t in texts(seed)]
    counting = Counting(tokenizer)
    builder = PromptBuilder(counting, "q", None, False, None, MAX_LEN, overflow)
    prompts, stats = builder.build(rows)
    expected = [whole(tokenizer, r["q"], overflow) for r in rows]
    got = {p.index: (p.text, p.ids) for p in prompts}
    assert got == {i: e for i, e in enumerate(expected) if e is not None}
    assert stats.skipped_too_long == sum(e is None for e in expected)
    assert (
        stats.truncated
        == sum(p.truncated for p in prompts)
        == (0 if overflow == "skip" else len(rows) - sum(len(tokenizer(r["q"])["input_ids"]) <= MAX_LEN for r in rows))
    )
    longest = max(len(r["q"]) for r in rows)
    assert longest > 20 * builder.window_chars and counting.longest <= 4 * builder.window_chars


def test_rows_stream_one_at_a_time(tmp_path):
    """A bad line is met only when reading reaches it: the rows before it were handed on one by one."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "a"}\n{"q": "b"}\n{not json\n')
    rows = iter_prompt_rows(str(path), "q", None, None)
    assert [next(rows)[0], next(rows)[0]] == [{"q": "a"}, {"q": "b"}]
    with pytest.raises(DataError, match="p.jsonl line 3: "):
        next(rows)


def test_a_mixed_row_is_tokenized_once_and_keeps_its_mixed_position(tok, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"q": f"a {i}"}) + "\n" for i in range(30)))
    b.write_text(json.dumps({"q": "b 0"}) + "\n")
    calls = []

    class Recording(Counting):
        def __call__(self, text, **kw):
            calls.extend([text] if isinstance(text, str) else text)
            return super().__call__(text, **kw)

    builder = PromptBuilder(Recording(tok), "q", None, False, None, 64)
    prompts, stats = read_prompts(f"{a},{b}", "0.5,0.5", "train", None, 0, builder)
    assert stats.total == len(prompts) > 31 and [p.index for p in prompts] == list(range(len(prompts)))
    assert sum(p.text == "b 0" for p in prompts) > 1 and calls.count("b 0") == 1  # b repeats; tokenized once


def test_a_slow_read_shows_a_bar_and_a_quick_one_nothing(tok, tmp_path, capsys, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(50)))
    builder = PromptBuilder(tok, "q", None, False, None, 64)
    read_prompts(str(path), None, "train", None, 0, builder)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(prompt_rows, "PROGRESS_DELAY_S", 0.0)
    read_prompts(str(path), None, "train", None, 0, builder)
    assert "prompts p.jsonl" in capsys.readouterr().err


def test_prompts_share_one_int_object_per_token_id(tok):
    """Token ids past 256 are new int objects each time the tokenizer returns them; held prompts share one."""
    (a, b), _ = PromptBuilder(tok, "q", None, False, None, 64).build([{"q": "say colors: magenta"}] * 2)
    assert a.ids == b.ids and max(a.ids) > 256 and all(x is y for x, y in zip(a.ids, b.ids))
