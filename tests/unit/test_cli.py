"""The `orlhf train-ppo` flag surface: every OpenRLHF flag accepted in both spellings, errors exit 2."""

import os
import subprocess
import sys

import pytest

from orlhf.cli import fill_optional_values, main

# Frozen on purpose: users bring OpenRLHF launch scripts, so removing or renaming any of these breaks them.
OPENRLHF_FLAGS = """
actor_num_nodes actor_num_gpus_per_node critic_num_nodes critic_num_gpus_per_node ref_num_nodes
ref_num_gpus_per_node reward_num_nodes reward_num_gpus_per_node colocate_actor_ref colocate_critic_reward
colocate_all_models vllm_num_engines vllm_tensor_parallel_size vllm_sync_backend vllm_sync_with_ray
vllm_gpu_memory_utilization
enable_prefix_caching enforce_eager vllm_enable_sleep zero_stage bf16 gradient_checkpointing adam_offload
ref_reward_offload flash_attn deepspeed_enable_sleep packing_samples pretrain reward_pretrain critic_pretrain
remote_rm_url prompt_data input_key label_key apply_chat_template input_template max_samples num_episodes
rollout_batch_size micro_rollout_batch_size train_batch_size micro_train_batch_size max_epochs prompt_max_len
generate_max_len actor_learning_rate critic_learning_rate lr_warmup_ratio init_kl_coef kl_target kl_horizon
kl_estimator use_kl_loss advantage_estimator n_samples_per_prompt gamma lambd eps_clip value_clip dual_clip
normalize_reward reward_clip_range entropy_loss_coef temperature top_p seed async_train async_queue_size
use_wandb wandb_project wandb_run_name use_tensorboard save_path ckpt_path save_steps logging_steps
max_ckpt_num load_checkpoint save_hf_ckpt agent_func_path eval_dataset eval_split eval_steps eval_temperature
eval_n_samples_per_prompt eval_before_train best_metric_key
""".split()
FIRST_RUN_PANELS = ["Model and data", "Rewards", "Algorithm", "Rollout", "Placement and device", "Output and logging"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def help_text(argv, capsys, monkeypatch, columns=80):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, _ = run(argv, capsys)
    assert code == 0
    return out


def test_help_shows_a_first_run_by_task_and_points_to_help_all(capsys, monkeypatch):
    """`--help` at 80 columns: the first-run flags only, in the six task panels in their order, short enough to
    read, ending with the line that names --help-all."""
    from orlhf.config.panels import FIRST_RUN

    out = help_text(["train-ppo", "--help"], capsys, monkeypatch)
    lines = out.rstrip().splitlines()
    assert len(lines) < 200, len(lines)
    for flag in FIRST_RUN:
        assert f"--{flag} " in out, flag
    assert "--critic_max_norm" not in out and "--zpg " not in out  # the rest is --help-all's
    starts = [out.index(f"─ {panel} ") for panel in FIRST_RUN_PANELS]
    assert starts == sorted(starts)
    assert "--help-all shows every flag" in " ".join(line.strip() for line in lines[-3:])


def test_help_all_shows_every_flag_grouped_by_task(capsys, monkeypatch):
    from orlhf.config.flags import flag_fields
    from orlhf.config.panels import PANELS

    out = help_text(["train-ppo", "--help-all"], capsys, monkeypatch, columns=200)
    for _, flag, _, _ in flag_fields():
        assert f"--{flag} " in out, flag
    for flag in OPENRLHF_FLAGS + ["print_config"]:
        assert f"--{flag} " in out, flag
    starts = [out.index(f"─ {p.title} ") for p in PANELS]
    assert starts == sorted(starts)
    assert "--pretrain" in out and "several comma-separated" in out  # the full help, not the one-line one
    assert help_text(["train-ppo", "--help_all"], capsys, monkeypatch, columns=200) == out


@pytest.mark.parametrize("argv", [["train-ppo", "--help"], ["train-ppo", "--help-all"], ["plan", "--help"]])
def test_help_reads_at_80_columns(argv, capsys, monkeypatch):
    """No flag name cut with '…' and no line past 80 characters."""
    out = help_text(argv, capsys, monkeypatch)
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_plan_help_shows_a_first_run_and_its_cluster(capsys, monkeypatch):
    out = help_text(["plan", "--help"], capsys, monkeypatch)
    assert "--pretrain " in out and "--nodes " in out and "--gpus_per_node " in out and "--zpg " not in out
    assert "--print_config" not in out  # train-ppo's own
    assert "--zpg " in help_text(["plan", "--help-all"], capsys, monkeypatch, columns=200)


def test_flags_only_help_all_shows_still_parse(capsys, no_training):
    code, _, err = run(["train-ppo", "--critic_max_norm", "0.5", "--zpg", "1", "--device", "cpu"], capsys)
    assert code == 0, err
    assert no_training[0].optim.critic_max_norm == 0.5


def test_an_unknown_flag_names_the_nearest_ones(capsys):
    """Click's suggestion covers every flag, the ones --help leaves to --help-all too."""
    code, _, err = run(["train-ppo", "--critic_max_nrm", "0.5"], capsys)
    assert code == 2 and "No such option: --critic_max_nrm" in err and "--critic_max_norm" in err
    code, _, err = run(["train-ppo", "--pretrian", "x"], capsys)
    assert code == 2 and "--pretrain" in err


def test_valid_flags_in_both_spellings(capsys, no_training):
    argv = [
        "train-ppo",
        "--actor_num_gpus_per_node",
        "2",
        "--ref-num-gpus-per-node",
        "2",
        "--colocate-actor-ref",
        "--advantage-estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--bf16",
        "--zero-stage",
        "2",
        "--reward_clip_range",
        "-5",
        "5",
        "--use_wandb",
        "--use-tensorboard",
        "/tmp/tb",
        "--device",
        "cpu",
    ]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    (cfg,) = no_training
    assert cfg.placement.actor_num_gpus_per_node == 2 and cfg.placement.ref_num_gpus_per_node == 2
    assert cfg.placement.colocate_actor_ref and cfg.ppo.advantage_estimator == "group_norm"
    assert cfg.deepspeed.bf16 and cfg.deepspeed.zero_stage == 2 and cfg.ppo.reward_clip_range == (-5.0, 5.0)
    assert cfg.logging.use_wandb == "" and cfg.logging.use_tensorboard == "/tmp/tb"


def test_invalid_combination_exits_2_naming_flags_without_traceback(capsys):
    code, _, err = run(["train-ppo", "--advantage_estimator", "rloo", "--vllm_enable_sleep"], capsys)
    assert code == 2
    assert "--n_samples_per_prompt" in err and "--vllm_enable_sleep" in err and "--colocate_all_models" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--reward_retries", "--reward_timeout_s"])
def test_negative_reward_retries_or_deadline_exit_2_naming_the_flag(flag, capsys):
    code, _, err = run(["train-ppo", flag, "-1"], capsys)
    assert code == 2 and f"{flag} must be" in err and "Traceback" not in err


def test_bad_choice_and_bad_type_exit_2(capsys):
    assert run(["train-ppo", "--zero_stage", "5"], capsys)[0] == 2
    assert run(["train-ppo", "--kl_estimator", "k9"], capsys)[0] == 2
    assert run(["train-ppo", "--eps_clip", "abc"], capsys)[0] == 2
    assert run(["train-ppo", "--no_such_flag", "1"], capsys)[0] == 2


def test_optional_value_flags():
    assert fill_optional_values(["--use_wandb", "--bf16"]) == ["--use_wandb", "", "--bf16"]
    assert fill_optional_values(["--use-wandb", "KEY"]) == ["--use-wandb", "KEY"]
    assert fill_optional_values(["--use_tensorboard"]) == ["--use_tensorboard", ""]


def test_demo_preset_is_announced(capsys, no_training):
    code, _, err = run(["train-ppo", "--generate_max_len", "8"], capsys)
    assert code == 0
    assert "built-in tiny demo" in err and "--generate_max_len" not in err.split("preset")[1]


def test_cli_imports_no_heavy_packages():
    """`orlhf --help` stays fast because the CLI never imports torch, ray, deepspeed or vllm."""
    code = (
        "import sys, orlhf.cli; heavy = [m for m in ('torch', 'ray', 'deepspeed', 'vllm', 'transformers') "
        "if m in sys.modules]; print(heavy); sys.exit(bool(heavy))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr


def test_openrlhf_mix_and_head_flags_parse(capsys, no_training, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text('{"input": "hi"}\n')
    argv = [
        "train-ppo",
        "--prompt_data",
        f"{a},{b}",
        "--prompt-data-probs",
        "0.7,0.3",
        "--prompt_split",
        "test",
        "--value-head-prefix",
        "value_head",
        "--device",
        "cpu",
    ]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    d = no_training[0].data
    assert (d.prompt_data_probs, d.prompt_split, d.value_head_prefix) == ("0.7,0.3", "test", "value_head")
    code, _, err = run(argv[:3] + ["--prompt_data_probs", "0.5,0.3,0.2", "--device", "cpu"], capsys)
    assert code == 2 and "--prompt_data_probs 0.5,0.3,0.2: 3 values for 2 --prompt_data sources" in err, err


def test_loss_variant_flags_parse(capsys, no_training):
    argv = [
        "train-ppo",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--eps_clip_low_high",
        "0.2",
        "0.28",
        "--policy-loss-type",
        "ppo",
        "--enable_vllm_is_correction",
        "--vllm_is_truncated_threshold",
        "0.4",
        "4",
        "--dynamic_filtering",
        "--dynamic_filtering_reward_range",
        "0",
        "1",
        "--overlong_buffer_len",
        "8",
        "--stop_properly_penalty_coef",
        "-0.5",
        "--adam_betas",
        "0.9",
        "0.99",
        "--l2",
        "0.01",
        "--max_norm",
        "0.5",
        "--lr_scheduler",
        "cosine",
        "--loss_agg_mode",
        "token_mean",
    ]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    (cfg,) = no_training
    p = cfg.ppo
    assert p.eps_clip_low_high == (0.2, 0.28) and p.policy_loss_type == "ppo" and p.enable_vllm_is_correction
    assert p.vllm_is_truncated_threshold == (0.4, 4.0) and p.dynamic_filtering and p.overlong_buffer_len == 8.0
    assert (p.stop_properly_penalty_coef, p.adam_betas, p.l2, p.max_norm) == (-0.5, (0.9, 0.99), 0.01, 0.5)
    assert p.lr_scheduler == "cosine" and p.loss_agg_mode == "token_mean"
    code, _, err = run(["train-ppo", "--policy-loss-type", "gspo", "--enable_vllm_is_correction"], capsys)
    assert code == 0, err
    assert no_training[-1].ppo.policy_loss_type == "gspo" and no_training[-1].ppo.enable_vllm_is_correction
    code, _, err = run(
        [
            "train-ppo",
            "--policy_loss_type",
            "gspo",
            "--enable_vllm_is_correction",
            "--vllm_is_correction_type",
            "seq-mask-tis",
        ],
        capsys,
    )
    assert code == 2 and "--policy_loss_type gspo" in err and "--vllm_is_correction_type seq-mask-tis" in err


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--vllm_is_correction_type", "icepop"], ["--vllm_is_correction_type", "--enable_vllm_is_correction"]),
        (
            ["--vllm-is-truncated-threshold", "0.4", "4"],
            ["--vllm_is_truncated_threshold", "--enable_vllm_is_correction"],
        ),
        (["--dynamic_filtering_reward_range", "0", "1"], ["--dynamic_filtering_reward_range", "--dynamic_filtering"]),
        (["--overlong_penalty_factor", "0.5"], ["--overlong_penalty_factor", "--overlong_buffer_len"]),
        (["--eps_clip", "0.2", "--eps_clip_low_high", "0.2", "0.28"], ["--eps_clip ", "--eps_clip_low_high"]),
        (
            ["--policy_loss_type", "gspo", "--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.4", "4"],
            ["--vllm_is_truncated_threshold 0.4 4.0", "--policy_loss_type gspo"],
        ),
        # tis is the default type: given explicitly next to GSPO it still does nothing (OpenRLHF ignores it there)
        (
            ["--policy_loss_type", "gspo", "--enable_vllm_is_correction", "--vllm_is_correction_type", "tis"],
            ["--vllm_is_correction_type tis", "--policy_loss_type gspo"],
        ),
    ],
)
def test_a_flag_given_without_the_flag_it_needs_exits_2(argv, names, capsys, no_training):
    """Given, these flags would be silently ignored: exit 2 before anything starts, naming both flags. Their
    defaults never trigger this (the demo's run above passes with all of them at their defaults)."""
    code, _, err = run(["train-ppo", *argv], capsys)
    assert code == 2 and not no_training, err
    assert any(all(n in line for n in names) for line in err.splitlines()), err


def test_user_errors_name_real_exception_classes():
    """cli.USER_ERRORS is looked up by name (no import before the run starts): every entry must be a class."""
    import importlib

    from orlhf.cli import USER_ERRORS, is_user_error

    for mod, name in USER_ERRORS:
        cls = getattr(importlib.import_module(mod), name)
        assert issubclass(cls, Exception), (mod, name)
        assert is_user_error(cls.__new__(cls))
    assert is_user_error(TimeoutError("slow")) and not is_user_error(ValueError("a bug"))


def test_run_reporting_errors_prints_user_errors_and_raises_bugs(capsys):
    from orlhf.cli import run_reporting_errors
    from orlhf.storage.checkpoint_format import CheckpointError

    def fail(exc):
        def fn(_cfg):
            raise exc

        return fn

    assert run_reporting_errors(fail(CheckpointError("no checkpoint in /x")), None) == 1
    assert "error: no checkpoint in /x" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a bug"):
        run_reporting_errors(fail(ValueError("a bug")), None)
    assert run_reporting_errors(lambda _cfg: 0, None) == 0


def test_reporting_errors_imports_no_torch_before_the_run():
    """The driver's main thread starts Ray inside the run; torch loads beside it (launch/run.py), not before it."""
    code = (
        "import sys; from orlhf.cli import run_reporting_errors; "
        "print(run_reporting_errors(lambda cfg: int('torch' in sys.modules), None))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
