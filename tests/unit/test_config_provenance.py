"""The resolved configuration (config/provenance.py): every setting with its value and where the value came from,
printed by `orlhf train-ppo --print_config` without starting anything, and read back from the file a run keeps."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from orlhf.cli import main
from orlhf.config.fingerprint import config_fingerprint
from orlhf.config.panels import PANELS
from orlhf.config.provenance import dump_resolved, read_resolved, resolved_config, resume_changes, sources_of
from orlhf.config.redact import public_config
from orlhf.config.train_config import TrainConfig, settings_of


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def table_rows(out: str) -> dict[str, tuple[str, str]]:
    """--print_config's table -> {flag: (value, source)} (values here have no spaces)."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("  --"):
            name, value, source = line.split(maxsplit=2)
            rows[name[2:]] = (value, source)
    return rows


def test_print_config_names_each_source_and_starts_nothing(capsys, no_training, tmp_path):
    argv = ["train-ppo", "--critic.max_norm", "0.5", "--max_new_tokens", "16", "--seed", "7"]
    code, out, err = run([*argv, "--save_path", str(tmp_path / "run"), "--print_config"], capsys)
    assert code == 0, err
    assert no_training == []  # launch's train_ppo was never called
    rows = table_rows(out)
    assert rows["critic_max_norm"] == ("0.5", "openrlhf --critic.max_norm")  # the dotted spelling, named
    assert rows["generate_max_len"] == ("16", "openrlhf --max_new_tokens 16")
    assert rows["seed"] == ("7", "flag")
    assert rows["num_episodes"] == ("10", "demo preset")  # no --pretrain: the demo's preset
    assert rows["device"][1] == "derived" and rows["device"][0] in ("cpu", "cuda")  # --device auto, resolved
    assert rows["vllm_sync_backend"][1] == "derived"
    assert rows["pretrain"][1] == "derived" and rows["pretrain"][0].endswith("model")  # the demo's, unbuilt
    assert rows["gamma"] == ("1.0", "default") and rows["actor_max_norm"] == ("none", "default")
    assert len(rows) == sum(len(p.flags) for p in PANELS) - 1  # every setting (--print_config is none)
    titles = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert titles[2:] == [p.title for p in PANELS] + [DERIVED_TITLE]  # the help panels in order, then the facts


DERIVED_TITLE = "Derived (what the settings above imply)"


def derived(out: str) -> dict[str, str]:
    """--print_config's closing block -> {fact: text}."""
    block = out.split(DERIVED_TITLE + "\n", 1)[1]
    return {name.strip(): value.strip() for name, value in (line.split("  ", 2)[1:] for line in block.splitlines())}


def test_print_config_ends_with_the_derived_facts(capsys, no_training, tmp_path):
    save = tmp_path / "run"
    code, out, err = run(["train-ppo", "--save_path", str(save), "--print_config"], capsys)
    assert code == 0, err
    facts = derived(out)
    assert facts["checkpoint folder"] == str(save / "checkpoints_ppo")
    assert facts["rollout backend"].startswith("vllm") and facts["engines placed"].startswith("1 (vllm")
    assert facts["reference model"].startswith("runs") == (float(table_rows(out)["init_kl_coef"][0]) > 0)
    argv = ["train-ppo", "--vllm_num_engines", "0", "--init_kl_coef", "0", "--ckpt_path", str(tmp_path / "ck")]
    code, out, err = run([*argv, "--save_path", str(save), "--print_config"], capsys)
    assert code == 0, err
    facts = derived(out)
    assert facts["checkpoint folder"] == str(tmp_path / "ck") and facts["engines placed"] == "none"
    assert facts["rollout backend"] == "trainer (generation memory: actor)"
    assert facts["reference model"].startswith("none: no KL reads it")


def test_print_config_keeps_the_flag_errors(capsys, no_training):
    code, out, err = run(["train-ppo", "--advantage_estimator", "rloo", "--print_config"], capsys)
    assert code == 2 and "--n_samples_per_prompt" in err and out == ""
    code, _, err = run(["train-ppo", "--ring_attn_size", "2", "--print_config"], capsys)
    assert code == 2 and "ring attention" in err


def test_print_config_imports_neither_ray_nor_torch(tmp_path):
    """Fast and side-effect free: no Ray start, no torch, and the demo is not built."""
    code = (
        "import sys; from orlhf.cli import main\n"
        "try:\n    main(['train-ppo', '--device', 'cpu', '--print_config'])\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('ray', 'torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    env = dict(os.environ, ORLHF_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout and str(tmp_path / "cache") in res.stdout
    assert not (tmp_path / "cache").exists()  # the demo's paths shown, nothing built


def test_the_native_spelling_given_last_counts_as_a_flag(capsys, no_training):
    code, _, err = run(
        ["train-ppo", "--actor.adam.lr", "1e-5", "--actor_learning_rate", "1e-5", "--device", "cpu"], capsys
    )
    assert code == 0, err
    assert sources_of(no_training[0])["actor_learning_rate"] == "flag"
    code, _, err = run(["train-ppo", "--param_dtype", "bf16", "--device", "cpu"], capsys)
    cfg = no_training[-1]
    assert sources_of(cfg)["bf16"] == "openrlhf --param_dtype bf16"
    assert sources_of(cfg)["input_key"] == "demo preset" and sources_of(cfg)["device"] == "flag"


def test_sources_leave_equality_fingerprints_and_asdict_alone(capsys, no_training):
    code, _, err = run(["train-ppo", "--device", "cpu", "--critic.max_norm", "0.5"], capsys)
    assert code == 0, err
    cfg = no_training[0]
    plain = dataclasses.replace(cfg, recorded_sources=())  # the same settings, no sources recorded
    assert cfg.sources and not plain.sources
    assert cfg == plain and config_fingerprint(cfg) == config_fingerprint(plain)
    assert settings_of(cfg) == settings_of(plain) and "recorded_sources" not in settings_of(cfg)
    assert public_config(cfg) == public_config(plain)  # the config sent to W&B
    assert sources_of(plain)["critic_max_norm"] == "not recorded" and sources_of(plain)["gamma"] == "default"


def test_the_run_folder_file_reads_back_and_compares_on_resume(capsys, no_training, tmp_path):
    code, _, err = run(["train-ppo", "--device", "cpu", "--use_wandb", "SECRET", "--lambd", "0.9"], capsys)
    assert code == 0, err
    cfg = no_training[0]
    path = tmp_path / "config.json"
    path.write_text(dump_resolved(cfg))
    stored = json.loads(path.read_text())
    assert list(stored) == list(resolved_config(cfg))
    assert stored["lambd"] == {"value": 0.9, "source": "flag"}
    assert stored["use_wandb"]["value"] == "<redacted>" and "SECRET" not in path.read_text()
    saved = read_resolved(path)
    assert saved["reward_clip_range"] == [-10.0, 10.0] and saved["lambd"] == 0.9
    assert resume_changes(saved, cfg) == []  # the same run
    code, _, err = run(["train-ppo", "--device", "cpu", "--lambd", "0.8", "--save_path", "/tmp/elsewhere"], capsys)
    changes = resume_changes(saved, no_training[-1])
    assert changes == ["--lambd: 0.9 when saved, 0.8 now (flag)"]  # --save_path is free on resume (fingerprint.py)


def test_a_config_built_in_code_reports_defaults():
    settings = resolved_config(TrainConfig())
    assert {s["source"] for s in settings.values()} == {"default"}
    assert settings["device"] == {"value": "auto", "source": "default"}
