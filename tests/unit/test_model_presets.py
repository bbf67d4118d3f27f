"""benchmarks/model_presets.py and the pieces built on it, without vLLM or Ray: the presets are the sizes they
advertise, a preset is built once and reused, the crossover is picked from given ratios, bench_generation's
--sweep defaults to the demo's step, and trl_compare's orlhf side on a preset runs the demo's exact settings on
another model. The sweep itself runs in benchmarks (speed is measured there, never asserted here)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import model_presets as mp  # noqa: E402

from orlhf.config.train_config import settings_of  # noqa: E402


@pytest.mark.parametrize("name", list(mp.PRESETS))
def test_each_preset_has_the_size_it_advertises(name):
    params = mp.preset_params(name)
    assert abs(params / 1e6 - mp.PRESETS[name].stated_m) <= 0.1 * mp.PRESETS[name].stated_m, params


def test_medium_is_about_20M_and_the_presets_grow():
    sizes = [mp.preset_params(n) for n in mp.PRESETS]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    assert 18e6 <= mp.preset_params("medium") <= 22e6


def test_a_preset_is_built_once_with_the_demo_tokenizer(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    monkeypatch.setattr(mp, "bench_cache", lambda: tmp_path)
    path = mp.preset_model("small")
    assert path.parent.parent == tmp_path and mp.param_count(path) == mp.preset_params("small")
    stamp = (path / "config.json").stat().st_mtime_ns
    assert mp.preset_model("small") == path and (path / "config.json").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    ids = AutoTokenizer.from_pretrained(path)("good happy day")["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(ensure_demo().model)("good happy day")["input_ids"]
    assert mp.preset_model("demo") == ensure_demo().model


def test_build_model_keeps_the_old_folder_name_for_default_shapes(tmp_path):
    # ppo_throughput --hidden/--layers caches built before the move stay valid
    assert mp.build_model(tmp_path, 32, 1, 100).name == "llama-h32-l1"
    assert mp.build_model(tmp_path, 32, 1, 100, intermediate=48).name == "llama-h32-l1-i48"
    assert mp.build_model(tmp_path, 32, 1, 1000).name == "llama-h32-l1-p1000"


def test_unknown_preset_names_are_refused_with_the_choices():
    with pytest.raises(SystemExit, match="'huge'.*demo, mini, small"):
        mp.parse_presets("demo,huge")
    assert mp.parse_presets("all") == list(mp.PRESETS)
    with pytest.raises(KeyError, match="medium"):
        mp.preset_model("huge")


def _rows(ratios):
    return [{"preset": n, "params": p, "ratio": r} for n, p, r in ratios]


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ([("demo", 1, 0.8), ("small", 4, 0.95), ("medium", 20, 1.3), ("large", 50, 1.6)], "medium"),
        ([("demo", 1, 0.8), ("small", 4, 1.05), ("medium", 20, 0.97), ("large", 50, 1.6)], "large"),  # not a dip
        ([("demo", 1, 0.8), ("medium", 20, 0.9)], None),
        ([("demo", 1, 1.1), ("medium", 20, 1.2)], "demo"),
        ([("medium", 20, 1.3), ("demo", 1, 0.8), ("small", 4, 1.0)], "medium"),  # order of the rows does not matter
    ],
)
def test_crossover_is_the_smallest_size_from_which_vllm_stays_ahead(ratios, expected):
    assert mp.crossover(_rows(ratios), "ratio") == expected


def test_crossover_text_names_the_bracket():
    rows = _rows([("demo", 0.6e6, 0.8), ("small", 3.7e6, 0.95), ("medium", 20.3e6, 1.3)])
    assert mp.describe_crossover(rows, "ratio") == "between small (3.7M, 0.95x) and medium (20.3M, 1.30x)"
    assert mp.describe_crossover(rows[:2], "ratio").startswith("not within the sizes tried (HF still ahead at small")
    assert mp.describe_crossover(rows[2:], "ratio").startswith("at or below medium")


def test_sweep_defaults_to_the_demo_step_and_reports_both_crossovers():
    import bench_generation as bg

    args = bg.parse_args(["--sweep", "demo,medium"])
    assert (args.sweep, args.num_prompts, args.n, args.max_new_tokens) == (["demo", "medium"], 64, 4, 24)
    assert args.variants == ["orlhf", "plain"]
    single = bg.parse_args(["--model", "/some/folder"])
    assert (single.n, single.max_new_tokens, single.variants) == (1, 64, list(bg.VLLM_VARIANTS))
    rows = [
        {
            "preset": "demo",
            "params": 0.6e6,
            "hf_tok_s": 1000,
            "vllm_tok_s": 800,
            "ratio": 0.8,
            "vllm_plain_tok_s": 1100,
            "ratio_plain": 1.1,
        },
        {
            "preset": "medium",
            "params": 20e6,
            "hf_tok_s": 100,
            "vllm_tok_s": 150,
            "ratio": 1.5,
            "vllm_plain_tok_s": 170,
            "ratio_plain": 1.7,
        },
    ]
    result = {
        "num_prompts": 64,
        "samples_per_prompt": 4,
        "max_new_tokens": 24,
        "repeats": 3,
        "threads_flag": 1,
        "sizes": rows,
        "crossover": {k: mp.crossover(rows, f"ratio{bg.suffix(k)}") for k in args.variants},
        "crossover_text": {k: mp.describe_crossover(rows, f"ratio{bg.suffix(k)}") for k in args.variants},
    }
    text = bg.sweep_table(result)
    assert "| medium | 20.0M | 100 | 150 | 1.50x | 170 | 1.70x |" in text
    assert "crossover, vLLM orlhf with log-probs (as orlhf's engines): between demo" in text
    assert "crossover, vLLM plain without log-probs: at or below demo" in text


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--sweep", "demo,huge"], "huge"),
        (["--sweep", "demo", "--model", "/x"], "leave out --model"),
        (["--variants", "orlhf,fast"], "fast"),
    ],
)
def test_bench_generation_refuses_bad_flags_with_exit_2(argv, named, capsys):
    import bench_generation as bg

    with pytest.raises(SystemExit) as e:
        bg.parse_args(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_trl_compare_on_a_preset_runs_the_demo_settings_on_that_model(tmp_path, monkeypatch, no_training):
    """Both configs through the real CLI: the preset's differs from the demo's in the model folder alone (the
    demo's prompts, reward and preset values, which train-ppo applies only without --pretrain, are spelled out)."""
    import trl_compare

    from orlhf.cli import main

    monkeypatch.setattr(mp, "bench_cache", lambda: tmp_path)
    configs = {}
    for preset in ("demo", "small"):
        a = trl_compare.parse_args(["--model_preset", preset, "--modes", "orlhf"])
        argv = trl_compare.with_model(trl_compare.orlhf_cmd(a, False), a)
        assert argv[:4] == [sys.executable, "-m", "orlhf.cli", "train-ppo"]
        with pytest.raises(SystemExit) as e:
            main([*argv[3:], "--save_path", str(tmp_path / "run")])
        assert e.value.code == 0
        configs[preset] = settings_of(no_training.pop())  # the settings, not where each came from
    assert configs["small"]["data"].pop("pretrain") == str(mp.preset_model("small"))
    assert configs["demo"]["data"].pop("pretrain") != configs["small"]["data"].get("pretrain")
    assert configs["small"] == configs["demo"]
    assert trl_compare.trl_cmd(a, Path("python"))[3] == str(mp.preset_model("small"))  # TRL: the same folder


def test_trl_compare_refuses_a_preset_with_its_own_model_flag(capsys):
    import trl_compare

    with pytest.raises(SystemExit) as e:
        trl_compare.parse_args(["--model_preset", "medium", "--orlhf_flags", "--pretrain /m"])
    assert e.value.code == 2 and "--pretrain" in capsys.readouterr().err
    assert os.path.basename(trl_compare.__file__) == "trl_compare.py"


def test_trl_compare_extra_modes_add_flags_to_the_sync_orlhf_command(capsys):
    import trl_compare

    a = trl_compare.parse_args(
        ["--modes", "orlhf", "--extra", "zero3=--zero_stage 3", "--extra", "e2=--vllm_num_engines 2"]
    )
    assert a.extra_cmds == {"zero3": ("--zero_stage", "3"), "e2": ("--vllm_num_engines", "2")}
    base, extra = trl_compare.orlhf_cmd(a, False), trl_compare.orlhf_cmd(a, False, a.extra_cmds["zero3"])
    assert extra == base + ["--zero_stage", "3"] and "--async_train" not in extra
    for bad in ("nosign", "=--bf16", "orlhf=--bf16"):  # no NAME=, an empty name, a built-in mode's name
        with pytest.raises(SystemExit) as e:
            trl_compare.parse_args(["--extra", bad])
        assert e.value.code == 2 and "--extra" in capsys.readouterr().err
