"""--prompt_data a,b with --prompt_data_probs and --prompt_split, as OpenRLHF's blending_datasets takes them."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from orlhf.config.flags import build_config
from orlhf.inputs.errors import DataError
from orlhf.inputs.prompt_mix import interleave_order, load_prompt_mix, parse_probs, split_sources


def write_jsonl(path, name, n):
    path.write_text("".join(json.dumps({"q": f"{name} {i}", "src": name}) + "\n" for i in range(n)))
    return str(path)


def mix(data, probs=None, split="train", max_samples=None, seed=42):
    return load_prompt_mix(data, probs, split, "q", None, max_samples, seed)


def test_sampling_mix_follows_the_probabilities(tmp_path):
    a, b = write_jsonl(tmp_path / "a.jsonl", "a", 2000), write_jsonl(tmp_path / "b.jsonl", "b", 2000)
    rows = mix(f"{a},{b}", "0.7,0.3", max_samples=2000)
    assert len(rows) == 2000
    share_a = sum(r["src"] == "a" for r in rows) / len(rows)
    # Binomial(2000, 0.7): std 0.010, so 0.03 is 3 sigma; the draw is seeded, so this is also reproducible.
    assert abs(share_a - 0.7) < 0.03, share_a
    assert rows == mix(f"{a},{b}", "0.7,0.3", max_samples=2000)  # same seed, same mix
    assert rows != mix(f"{a},{b}", "0.7,0.3", max_samples=2000, seed=43)


def test_mix_runs_until_every_source_was_used_whole(tmp_path):
    a, b = write_jsonl(tmp_path / "a.jsonl", "a", 30), write_jsonl(tmp_path / "b.jsonl", "b", 10)
    rows = mix(f"{a},{b}", "0.5,0.5")
    assert {r["q"] for r in rows} == {f"a {i}" for i in range(30)} | {f"b {i}" for i in range(10)}
    n_b = sum(r["src"] == "b" for r in rows)
    assert n_b >= 10  # b (the small source) repeats while a is being used up: ~30 of each in all
    order = interleave_order([30, 10], [0.5, 0.5], seed=42)
    assert len(order) == len(rows) and [r["q"] for r in rows] == [f"{'ab'[s]} {i}" for s, i in order]


def test_interleave_order_equals_datasets_interleave(tmp_path):
    datasets = pytest.importorskip("datasets")
    for lengths, probs, seed in (([5, 7, 3], [0.2, 0.5, 0.3], 0), ([40, 4], [0.9, 0.1], 42), ([3], [1.0], 1)):
        parts = [datasets.Dataset.from_dict({"s": [k] * n, "i": list(range(n))}) for k, n in enumerate(lengths)]
        ref = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
        assert list(zip(ref["s"], ref["i"])) == interleave_order(lengths, probs, seed), (lengths, probs, seed)


def test_without_probs_sources_are_concatenated_and_one_source_is_unchanged(tmp_path):
    from orlhf.inputs.prompt_rows import load_prompt_rows

    a, b = write_jsonl(tmp_path / "a.jsonl", "a", 3), write_jsonl(tmp_path / "b.jsonl", "b", 2)
    assert [r["q"] for r in mix(f"{a}, {b}")] == ["a 0", "a 1", "a 2", "b 0", "b 1"]
    assert [r["q"] for r in mix(f"{a},{b}", max_samples=2)] == ["a 0", "a 1"]  # in all, as OpenRLHF
    assert mix(a) == load_prompt_rows(a, "q", None, None)


def test_max_samples_is_the_first_picks_of_the_whole_mix(tmp_path):
    a, b = write_jsonl(tmp_path / "a.jsonl", "a", 50), write_jsonl(tmp_path / "b.jsonl", "b", 50)
    full = mix(f"{a},{b}", "0.6,0.4")
    # max_samples also caps each source first (OpenRLHF's max_count), so the order is that of 20-row sources.
    capped = mix(f"{a},{b}", "0.6,0.4", max_samples=20)
    small = [r["q"] for r in capped]
    order = interleave_order([20, 20], [0.6, 0.4], 42, limit=20)
    assert small == [f"{'ab'[s]} {i}" for s, i in order] and len(full) > 50


def test_prompt_split_picks_the_split_of_a_saved_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"q": "train row"}]),
            "test": datasets.Dataset.from_list([{"q": "test row"}, {"q": "test row 2"}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [r["q"] for r in mix(str(tmp_path / "dd"))] == ["train row"]
    assert [r["q"] for r in mix(str(tmp_path / "dd"), split="test")] == ["test row", "test row 2"]
    with pytest.raises(DataError, match=r"--prompt_split dev: .*dd has no split 'dev' \(splits: \['test', 'train'\]\)"):
        mix(str(tmp_path / "dd"), split="dev")
    a = write_jsonl(tmp_path / "a.jsonl", "a", 2)
    with pytest.raises(DataError, match=r"--prompt_split test: .*a.jsonl is a single file, whose only split"):
        mix(a, split="test")


def test_probs_errors_name_the_flag():
    with pytest.raises(DataError, match=r"--prompt_data_probs 0.5,0.3,0.2: 3 values for 2 --prompt_data sources"):
        parse_probs("0.5,0.3,0.2", ["a", "b"])
    with pytest.raises(DataError, match=r"sum to 0.9, not 1; e.g. --prompt_data_probs 0.6667,0.3333"):
        parse_probs("0.6,0.3", ["a", "b"])
    with pytest.raises(DataError, match=r"must be > 0 .* drop it from --prompt_data"):
        parse_probs("1,0", ["a", "b"])
    with pytest.raises(DataError, match=r"\['x'\] not numbers"):
        parse_probs("0.5,x", ["a", "b"])
    with pytest.raises(DataError, match="an empty entry"):
        split_sources("a,,b")
    assert parse_probs("0.1, 0.2, 0.7", ["a", "b", "c"]) == [0.1, 0.2, 0.7]


def test_start_up_line_says_prompts_once_and_the_mix_reaches_the_prompts(tmp_path, caplog):
    import logging

    from orlhf.config.resolve import resolve_demo
    from orlhf.demo.builder import ensure_demo
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.launch.run_inputs import load_prompts

    a, b = write_jsonl(tmp_path / "a.jsonl", "a", 40), write_jsonl(tmp_path / "b.jsonl", "b", 40)
    flags = {
        "prompt_data": f"{a},{b}",
        "prompt_data_probs": "0.25,0.75",
        "input_key": "q",
        "label_key": None,
        "max_samples": 40,
    }
    cfg = resolve_demo(build_config(flags, explicit=set(flags)))  # the demo's model and reward, these prompts
    with caplog.at_level(logging.INFO, logger="orlhf"):
        prompts = load_prompts(cfg, load_tokenizer(str(ensure_demo().model)))
    lines = [r.getMessage() for r in caplog.records if "used (" in r.getMessage()]
    assert lines == ["prompts: 40 of 40 used (0 empty skipped, 0 longer than --prompt_max_len skipped, 0 truncated)"], (
        lines
    )
    assert 0 < sum(p.text.startswith("a ") for p in prompts) < 20  # about 10 of 40 from a (p = 0.25)
