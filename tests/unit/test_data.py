"""Prompt data: every file format, errors that name the file/line/flag, formatting, length policy, the loader."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from orlhf.demo.builder import ensure_demo
from orlhf.inputs.errors import DataError
from orlhf.inputs.prompt_loader import PromptLoader
from orlhf.inputs.prompt_rows import load_prompt_rows
from orlhf.inputs.prompts import Prompt, build_prompts
from orlhf.inputs.tokenizer import load_tokenizer

ROWS = [{"q": f"say colors: red {i}", "a": f"label{i}"} for i in range(5)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ensure_demo().model))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prompts_of(rows, tok, max_len=64, **kw):
    args = dict(input_key="q", label_key="a", apply_chat_template=False, input_template=None, prompt_max_len=max_len)
    return build_prompts(rows, tok, **{**args, **kw})


# ---- formats ----


def test_jsonl_json_parquet_and_saved_folder_give_the_same_rows(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    (tmp_path / "cols.json").write_text(json.dumps({"q": [r["q"] for r in ROWS], "a": [r["a"] for r in ROWS]}))
    (tmp_path / "field.json").write_text(json.dumps({"data": ROWS}))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in ROWS))  # JSON lines named .json
    paths = [write_jsonl(tmp_path / "p.jsonl", ROWS)] + [
        str(tmp_path / n)
        for n in ("p.parquet", "saved", "saved_dict", "list.json", "cols.json", "field.json", "lines.json")
    ]
    for path in paths:
        assert load_prompt_rows(path, "q", "a", None) == ROWS, path


def test_max_samples_takes_the_first_rows_in_every_format(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    for path in (write_jsonl(tmp_path / "p.jsonl", ROWS), str(tmp_path / "p.parquet"), str(tmp_path / "p.json")):
        assert load_prompt_rows(path, "q", None, 2) == ROWS[:2]


def test_max_samples_stops_before_a_later_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n{broken\n")  # blank line: not a row
    assert load_prompt_rows(str(path), "q", None, 2) == ROWS[:2]


def test_dataset_dict_without_train_lists_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(DataError, match=r"--prompt_split train: .* has no split 'train' \(splits: \['test'\]\)"):
        load_prompt_rows(str(tmp_path / "d"), "q", None, None)


def test_unsupported_suffix_and_plain_folder_are_named(tmp_path):
    (tmp_path / "p.csv").write_text("q\nhello\n")
    with pytest.raises(DataError, match=r"p\.csv: unsupported format '\.csv'; use \.jsonl"):
        load_prompt_rows(str(tmp_path / "p.csv"), "q", None, None)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder: a folder, but not one written by datasets' save_to_disk"):
        load_prompt_rows(str(tmp_path / "folder"), "q", None, None)


# ---- row errors ----


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps(r) for r in ROWS[:3]] + ['{"q": "x" "a": "y"}'] + [json.dumps(ROWS[4])]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        load_prompt_rows(str(path), "q", "a", None)
    msg = str(e.value)
    assert "prompts.jsonl line 4: Expecting ',' delimiter" in msg and "fix or remove that line" in msg


def test_non_object_row_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '["not", "an", "object"]\n')
    with pytest.raises(DataError, match=r"p\.jsonl line 2: expected an object.*got list"):
        load_prompt_rows(str(path), "q", None, None)


def test_missing_input_key_names_key_flag_file_and_present_keys(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(DataError) as e:
        load_prompt_rows(path, "input", None, None)
    msg = str(e.value)
    assert "p.jsonl line 1" in msg and "'input'" in msg and "--input_key" in msg and "['a', 'q']" in msg


def test_missing_label_key_names_the_flag(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:2] + [{"q": "no label"}])
    with pytest.raises(DataError, match=r"p\.jsonl line 3: no field 'a' \(--label_key\); the row has fields \['q'\]"):
        load_prompt_rows(path, "q", "a", None)


def test_no_rows_and_all_empty_prompts_are_errors(tmp_path):
    with pytest.raises(DataError, match="no rows"):
        load_prompt_rows(write_jsonl(tmp_path / "none.jsonl", []), "q", None, None)
    with pytest.raises(DataError, match=r"every prompt in field 'q' \(--input_key\) is empty"):
        load_prompt_rows(write_jsonl(tmp_path / "empty.jsonl", [{"q": " "}, {"q": ""}]), "q", None, None)


def test_empty_prompts_are_skipped_and_counted_keeping_row_indices(tmp_path, tok):
    rows = [ROWS[0], {"q": "  \n", "a": "x"}, ROWS[2]]
    prompts, stats = prompts_of(load_prompt_rows(write_jsonl(tmp_path / "p.jsonl", rows), "q", "a", None), tok)
    assert [p.index for p in prompts] == [0, 2] and [p.label for p in prompts] == ["label0", "label2"]
    assert (stats.total, stats.used, stats.skipped_empty) == (3, 2, 1)
    assert "2 of 3 used (1 empty skipped" in stats.summary()


# ---- formatting and tokenizing ----


def test_plain_prompt_round_trips_and_adds_no_special_tokens_on_the_demo_tokenizer(tok):
    (p,), _ = prompts_of(ROWS[:1], tok)
    assert p == Prompt(text=ROWS[0]["q"], ids=tok(ROWS[0]["q"]).input_ids, label="label0", index=0)
    assert tok.decode(p.ids) == p.text and tok.bos_token_id not in p.ids


def test_input_template_formats_the_prompt(tok):
    (p,), _ = prompts_of([{"q": "red cat", "a": ""}], tok, input_template="Q: {}\nA:")
    assert p.text == "Q: red cat\nA:" and tok.decode(p.ids) == p.text


def test_chat_template_wraps_text_and_message_lists(tok):
    rows = [{"q": "say colors: red", "a": ""}, {"q": [{"role": "user", "content": "hi"}], "a": ""}]
    prompts, _ = prompts_of(rows, tok, apply_chat_template=True)
    assert [p.text for p in prompts] == ["user: say colors: red\nassistant:", "user: hi\nassistant:"]
    assert tok.decode(prompts[0].ids) == prompts[0].text


def test_chat_template_missing_and_both_templates_name_the_flags(tok, monkeypatch):
    with pytest.raises(DataError, match="--input_template and --apply_chat_template are both given"):
        prompts_of(ROWS, tok, apply_chat_template=True, input_template="Q: {}")
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(DataError, match="--apply_chat_template: the tokenizer of .* has no chat template"):
        prompts_of(ROWS, tok, apply_chat_template=True)


def test_message_list_without_chat_template_is_an_error(tok):
    with pytest.raises(DataError, match=r"row 1: the prompt \('q', --input_key\) is a list.*needs --apply_chat_"):
        prompts_of([{"q": [{"role": "user", "content": "hi"}], "a": ""}], tok)


def test_non_text_prompt_and_missing_file_are_named(tmp_path):
    with pytest.raises(DataError, match=r"p\.jsonl line 1: the prompt \('q', --input_key\) is a int"):
        load_prompt_rows(write_jsonl(tmp_path / "p.jsonl", [{"q": 3}]), "q", None, None)
    with pytest.raises(DataError, match=r"--prompt_data .*gone\.jsonl: no such file"):
        load_prompt_rows(str(tmp_path / "gone.jsonl"), "q", None, None)


def test_too_long_prompts_skip_or_keep_their_end(tok):
    long_text = "say colors: " + " ".join(["red"] * 20)  # 2 + 20 tokens
    rows = [{"q": long_text, "a": "x"}, ROWS[1]]
    prompts, stats = prompts_of(rows, tok, max_len=8)
    assert [p.index for p in prompts] == [1] and (stats.skipped_too_long, stats.truncated, stats.used) == (1, 0, 1)
    prompts, stats = prompts_of(rows, tok, max_len=8, overflow="truncate")
    full = tok(long_text).input_ids
    assert prompts[0].ids == full[-8:] and prompts[0].text == tok.decode(full[-8:])
    assert long_text.endswith(prompts[0].text) and (stats.skipped_too_long, stats.truncated) == (0, 1)


def test_truncation_keeps_a_leading_bos(tok):
    from orlhf.inputs.prompts import _keep_end

    assert _keep_end([0, 5, 6, 7, 8], 3, head=0) == [0, 7, 8]  # the text starts with BOS (0)
    assert _keep_end([9, 5, 6, 7, 8], 3, head=None) == [6, 7, 8]


def test_nothing_left_suggests_the_flags(tok):
    with pytest.raises(DataError, match=r"no prompts left.*--prompt_max_len \(now 2\).*--prompt_overflow truncate"):
        prompts_of(ROWS, tok, max_len=2)


def test_load_tokenizer_pads_left_and_errors_name_pretrain(tmp_path, tok):
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    with pytest.raises(DataError, match=r"--pretrain .*nothing: cannot load its tokenizer"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_load_tokenizer_falls_back_to_eos_as_pad(tmp_path):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(ensure_demo().model)
    t.pad_token = None
    t.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "</s>"


# ---- loader ----


def make_prompts(n):
    return [Prompt(text=str(i), ids=[i], label=None, index=i) for i in range(n)]


def indices(batches):
    return [[p.index for p in b] for b in batches]


def test_loader_batches_drop_last_and_reshuffle_each_episode():
    loader = PromptLoader(make_prompts(10), batch_size=3, num_episodes=2, seed=1)
    assert (loader.steps_per_episode, loader.total_steps, len(loader)) == (3, 6, 6)
    batches = indices(loader)
    assert len(batches) == 6 and all(len(b) == 3 for b in batches)
    ep0, ep1 = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(ep0)) == 9 and len(set(ep1)) == 9  # each episode: 9 distinct prompts, the 10th dropped
    assert ep0 != ep1  # a new order per episode
    assert indices(PromptLoader(make_prompts(10), 3, 2, seed=1)) == batches  # same seed, same order
    assert indices(PromptLoader(make_prompts(10), 3, 2, seed=2)) != batches
    assert list(loader) == []  # exhausted: iterating again yields nothing


def test_loader_resume_yields_the_uninterrupted_sequence():
    full = indices(PromptLoader(make_prompts(10), 3, 3, seed=7))
    for k in range(len(full) + 1):
        first = PromptLoader(make_prompts(10), 3, 3, seed=7)
        it = iter(first)
        head = indices(next(it) for _ in range(k))
        state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
        resumed = PromptLoader(make_prompts(10), 3, 3, seed=7)
        resumed.load_state_dict(state)
        assert resumed.steps_done == k
        assert head + indices(resumed) == full, k


def test_loader_errors_name_the_flags():
    with pytest.raises(DataError, match="4 usable prompts but --rollout_batch_size 5"):
        PromptLoader(make_prompts(4), batch_size=5, num_episodes=1, seed=0)
    state = PromptLoader(make_prompts(10), 3, 1, seed=0).state_dict()
    with pytest.raises(DataError, match="resume with the same --prompt_data.*--rollout_batch_size and --seed"):
        PromptLoader(make_prompts(10), 2, 1, seed=0).load_state_dict(state)


def test_demo_prompts_load_end_to_end(tok):
    demo = ensure_demo()
    rows = load_prompt_rows(str(demo.prompts), "prompt", "label", None)
    prompts, stats = build_prompts(rows, tok, "prompt", "label", False, None, 64)
    assert stats.used == stats.total == 512 and prompts[0].label == "colors"
    assert PromptLoader(prompts, 64, 4, seed=42).total_steps == 32


# ---- bad input: one clear line each ----


def test_utf8_bom_files_are_accepted(tmp_path):
    rows = [{"q": "say colors: red", "a": "x"}, {"q": "say colors: blue", "a": "y"}]
    jsonl, js = tmp_path / "bom.jsonl", tmp_path / "bom.json"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    js.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert load_prompt_rows(str(jsonl), "q", "a", None) == rows
    assert load_prompt_rows(str(js), "q", "a", None) == rows


@pytest.mark.parametrize(
    "message, got",
    [
        ({"role": "user"}, "got ['role']"),
        ({"role": "user", "text": "hi"}, "got ['role', 'text']"),
        ({"role": "user", "content": None}, "got ['content', 'role']"),
        ("hi", "got str"),
    ],
)
def test_chat_rows_without_content_name_the_row_and_message(tok, message, got):
    rows = [{"q": "fine", "a": ""}, {"q": [{"role": "system", "content": "be brief"}, message], "a": ""}]
    with pytest.raises(DataError) as e:
        prompts_of(rows, tok, apply_chat_template=True)
    msg = str(e.value)
    assert msg.startswith("row 2: message 2 of the conversation in 'q' (--input_key)") and got in msg, msg
    assert "\n" not in msg
