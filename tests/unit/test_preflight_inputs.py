"""Bad input a run meets before Ray starts, each one clear message and exit 2 (config/validation_inputs.py,
inputs/model_files.py, launch/run.py's pre-flight): lengths past the model's positions, run and checkpoint folders
that cannot be written, truncated or missing weight files; a reward_func that calls sys.exit; a reward file that
does not import, met before anything is placed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orlhf.cli import main
from orlhf.config.flags import build_config
from orlhf.config.train_config import ConfigError
from orlhf.config.validation_inputs import folder_problem
from orlhf.inputs.model_files import max_positions, weight_file_problem

REPO = Path(__file__).resolve().parents[2]


def problems(**flags) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build_config(flags, explicit=set(flags))
    return err.value.problems


def cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


@pytest.fixture
def inputs(tmp_path):
    """{"prompt_data", "remote_rm_url"}: a prompt file and a reward file, for runs given --pretrain."""
    (tmp_path / "p.jsonl").write_text('{"input": "hi"}\n')
    (tmp_path / "r.py").write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    return {"prompt_data": str(tmp_path / "p.jsonl"), "remote_rm_url": str(tmp_path / "r.py")}


def model_with(tmp_path, **config) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# ---- lengths against the actor's positions ----


def test_positions_are_read_as_vllm_derives_them():
    assert max_positions({"max_position_embeddings": 512}) == (512, "max_position_embeddings")
    assert max_positions({"n_positions": 1024, "n_ctx": 1024}) == (1024, "n_positions")  # GPT-2
    assert max_positions({"max_position_embeddings": 4096, "seq_length": 2048}) == (2048, "seq_length")  # smallest
    assert max_positions({"max_position_embeddings": 8192, "model_max_length": 16384})[0] == 16384  # it wins
    linear = {"type": "linear", "factor": 4.0}
    assert max_positions({"max_position_embeddings": 2048, "rope_scaling": linear}) == (8192, "max_position_embeddings")
    llama3 = {"rope_type": "llama3", "factor": 8.0}  # already the scaled length
    assert max_positions({"max_position_embeddings": 131072, "rope_parameters": llama3})[0] == 131072
    assert max_positions({"text_config": {"max_position_embeddings": 262144}})[0] == 262144  # a VLM's language model
    assert max_positions({"hidden_size": 8}) is None  # nothing to read: no claim


def test_lengths_past_the_models_positions_fail_naming_both_flags_the_limit_and_a_fit(tmp_path, inputs):
    model = model_with(tmp_path, max_position_embeddings=512)
    [msg] = [p for p in problems(pretrain=model, **inputs) if "positions" in p]  # the defaults: 1024 + 1024
    assert msg == (
        f"--prompt_max_len 1024 + --generate_max_len 1024 = 2048 tokens is past the 512 positions of --pretrain "
        f"{model} (max_position_embeddings in its config.json): lower them to add up to 512 or less, e.g. "
        "--prompt_max_len 256 --generate_max_len 256."
    )
    build_config(dict(pretrain=model, prompt_max_len=256, generate_max_len=256, **inputs), set())  # fits exactly
    # --max_len caps a sequence (the engines' max_model_len is the smaller one)
    build_config(dict(pretrain=model, prompt_max_len=64, max_len=512, **inputs), {"prompt_max_len", "max_len"})
    [msg] = problems(pretrain=model, prompt_max_len=64, generate_max_len=1000, max_len=600, **inputs)
    assert msg.startswith("--max_len 600 is past the 512 positions") and "lower --max_len to 512" in msg


def test_gpt2_positions_and_the_demo_model_are_checked_too(tmp_path, inputs, monkeypatch):
    model = model_with(tmp_path, n_positions=128)
    [msg] = problems(pretrain=model, prompt_max_len=64, generate_max_len=100, **inputs)
    assert "past the 128 positions" in msg and "(n_positions in its config.json)" in msg
    assert "e.g. --prompt_max_len 64 --generate_max_len 64" in msg
    [msg] = problems(generate_max_len=1000)  # no --pretrain: the demo's preset prompt length, its model's 512
    assert "--prompt_max_len 64 + --generate_max_len 1000" in msg and "the built-in demo model" in msg
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override lifts the check as well
    build_config({"generate_max_len": 1000}, {"generate_max_len"})


def test_plan_refuses_lengths_past_the_positions_too(tmp_path, inputs, capsys):
    model = model_with(tmp_path, max_position_embeddings=512, hidden_size=64, num_hidden_layers=2, vocab_size=100)
    flags = ["--pretrain", model, "--prompt_data", inputs["prompt_data"], "--remote_rm_url", inputs["remote_rm_url"]]
    code, _, err = cli(["plan", *flags, "--device", "cpu"], capsys)
    assert code == 2 and "--prompt_max_len 1024 + --generate_max_len 1024 = 2048 tokens is past the 512" in err


def test_make_demo_prints_commands_that_fit_its_model(tmp_path, capsys, no_training, monkeypatch):
    from orlhf.demo import builder

    monkeypatch.setattr(builder, "make_demo", lambda out, seed=0: builder.ensure_demo())  # the cached build
    code, out, _ = cli(["make-demo", str(tmp_path / "demo")], capsys)
    assert code is None or code == 0, out
    commands = [line.split(": ", 1)[1].split() for line in out.splitlines() if "orlhf train-ppo" in line]
    assert len(commands) == 2
    for command in commands:
        assert command[:2] == ["orlhf", "train-ppo"]
        code, _, err = cli(command[1:], capsys)
        assert code == 0, err
    assert [cfg.ppo.generate_max_len for cfg in no_training] == [24, 8]


# ---- run and checkpoint folders ----


def test_folders_that_cannot_be_made_or_written_are_named(tmp_path, monkeypatch):
    file = tmp_path / "file"
    file.write_text("x")
    assert folder_problem(str(file)) == f"{file} is a file, not a folder"
    assert folder_problem(str(file / "run")) == f"{file} is a file, so no folder can be made in it"
    assert folder_problem(str(tmp_path / "new" / "run")) is None
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes in a 0555 folder: a read-only mount is what refuses it
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: access(p, mode) and Path(p) != ro)
    assert folder_problem(str(ro)) == f"{ro} is not writable here (read-only)"
    assert folder_problem(str(ro / "run")) == f"{ro}, where it would be made, is not writable here (read-only)"


def test_save_path_and_ckpt_path_that_are_files_exit_2_before_the_run(tmp_path, capsys, no_training):
    file = tmp_path / "file"
    file.write_text("x")
    code, _, err = cli(["train-ppo", "--save_path", str(file)], capsys)
    assert code == 2 and not no_training
    assert err.splitlines()[1:] == [
        f"  - --save_path {file}: {file} is a file, not a folder; pass a folder you can write in (created if missing)."
    ]
    code, _, err = cli(["train-ppo", "--save_path", str(tmp_path / "run"), "--ckpt_path", str(file / "c")], capsys)
    assert code == 2 and not no_training and f"--ckpt_path {file / 'c'}: {file} is a file" in err
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "checkpoints_ppo").write_text("x")  # the default checkpoint folder, a file
    code, _, err = cli(["train-ppo", "--save_path", str(tmp_path / "run2")], capsys)
    assert code == 2 and "its checkpoint folder" in err and "--ckpt_path" in err


def test_make_demo_onto_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    code, out, err = cli(["make-demo", str(file)], capsys)
    assert code == 2 and not out
    assert (
        err.strip()
        == f"error: {file}: {file} is a file, not a folder; pass a folder you can write in (created if missing)."
    )


# ---- weight files ----


def demo_copy(tmp_path) -> Path:
    from orlhf.demo.builder import ensure_demo

    folder = tmp_path / "model"
    shutil.copytree(ensure_demo().model, folder)
    return folder


def test_truncated_or_missing_safetensors_are_named(tmp_path):
    folder = demo_copy(tmp_path)
    assert weight_file_problem(str(folder)) is None
    [weights] = folder.glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    assert weight_file_problem(str(folder)).startswith(f"{weights} is unreadable or truncated (its tensors end at")
    weights.write_bytes(data[:4])
    assert "header length" in weight_file_problem(str(folder))
    weights.write_bytes(data)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    names = [n for n in header if n != "__metadata__"]
    index = {"weight_map": {**{n: weights.name for n in names}, "lm_head.extra": weights.name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_file_problem(str(folder)) == (
        f"{weights} has no tensor 'lm_head.extra', which model.safetensors.index.json puts there"
    )
    index["weight_map"] = {names[0]: "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_file_problem(str(folder)) == (
        f"{folder / 'model-00002-of-00002.safetensors'}, named by model.safetensors.index.json, is missing"
    )


def test_a_truncated_model_in_a_run_without_a_critic_fails_the_preflight_naming_it(tmp_path, inputs):
    from orlhf.config.resolve import finish_config
    from orlhf.launch.preflight import preflight

    folder = demo_copy(tmp_path)
    [weights] = folder.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])
    flags = dict(
        pretrain=str(folder),
        advantage_estimator="reinforce",
        init_kl_coef=0.0,
        prompt_max_len=64,
        generate_max_len=24,
        save_path=str(tmp_path / "run"),
        **inputs,
    )
    cfg = finish_config(flags, set(flags))
    assert not cfg.has_critic
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    [msg] = err.value.problems
    assert msg.startswith(f"--pretrain {folder}: {weights} is unreadable or truncated") and "re-download" in msg


# ---- the reward file ----


def test_a_reward_func_calling_sys_exit_is_a_reward_error_naming_file_and_function(tmp_path):
    from orlhf.inputs.rewards import FunctionReward, RewardError

    path = tmp_path / "r.py"
    path.write_text("import sys\n\ndef reward_func(q, p, l):\n    sys.exit(3)\n")
    with pytest.raises(RewardError) as err:
        FunctionReward(path).score(["a"], ["a"], [""])
    first = str(err.value).splitlines()[0]
    assert first == f"{path}: reward_func called sys.exit(3)"
    assert f"{path}, line 4, in reward_func: sys.exit(3)" in str(err.value)
    path.write_text("def reward_func(q, p, l):\n    raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):  # an interrupt still interrupts
        FunctionReward(path).score(["a"], ["a"], [""])


def bad_reward(tmp_path) -> tuple[list[str], str]:
    bad = tmp_path / "bad_reward.py"
    bad.write_text("import no_such_module_here\n")
    return ["--remote_rm_url", str(bad)], f"error: {bad} failed to import: ModuleNotFoundError: No module named "


def bad_row(tmp_path) -> tuple[list[str], str]:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "say colors: red", "label": "colors"}\n{"prompt": "say\n')
    return ["--prompt_data", str(data)], f"error: {data} line 2: "


def no_tokenizer(tmp_path) -> tuple[list[str], str]:
    folder = demo_copy(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return ["--pretrain", str(folder)] + DEMO_FLAGS, f"error: --pretrain {folder}: cannot load its tokenizer"


def bad_targets(tmp_path) -> tuple[list[str], str]:
    return ["--lora_rank", "4", "--target_modules", "qproj", "vproj"], "--target_modules qproj: no module"


# the demo's prompts and reward for a --pretrain that is a copy of the demo model (the preset's lengths fit it)
DEMO_FLAGS = ["--prompt_max_len", "64", "--generate_max_len", "24", "--input_key", "prompt", "--label_key", "label"]


@pytest.mark.parametrize("case", [bad_reward, bad_row, no_tokenizer, bad_targets])
def test_errors_from_input_files_come_before_ray_starts(tmp_path, case):
    """A whole `orlhf train-ppo` on the demo with one bad input: the error names it, and Ray was never asked for.
    --address points at a cluster that does not exist: joining it would fail (or hang) with another error, so the
    input's error shows that the inputs were read before Ray's start."""
    from orlhf.demo.builder import ensure_demo

    flags, expected = case(tmp_path)
    demo = ensure_demo()
    if "--pretrain" in flags:
        flags += ["--prompt_data", str(demo.prompts), "--remote_rm_url", str(demo.reward_fn)]
    save = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "train-ppo", "--device", "cpu", "--save_path", str(save)]
        + ["--address", "127.0.0.1:1", *flags],
        env={**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode in (1, 2) and expected in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in (save / "logs").iterdir()) == ["driver.log"]  # no rank or engine started
