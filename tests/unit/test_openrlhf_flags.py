"""OpenRLHF launch lines on orlhf: all 144 v0.10.1 train_ppo_ray flags, dotted names, aliases and refusals."""

import pytest

from orlhf.cli import main, native_arity
from orlhf.config import flags as F
from orlhf.config.openrlhf import ALIASES, NO_EFFECT, OPENRLHF_V0101_FLAGS, UNSUPPORTED, CompatError, translate
from orlhf.config.openrlhf_dotted import DOTTED

# One value per flag, as an OpenRLHF v0.10.1 script would write it (switches take none). Unsupported features
# carry OpenRLHF's default, which asks for nothing; their refusal is tested below.
VALUES = {
    "vllm_sync_backend": ["gloo"],
    "vllm_gpu_memory_utilization": ["0.5"],
    "ckpt_path": ["/tmp/ck"],
    "zero_stage": ["3"],
    "param_dtype": ["bf16"],
    "attn_implementation": ["sdpa"],
    "save_path": ["/tmp/run"],
    "max_len": ["2048"],
    "max_new_tokens": ["1024"],
    "reward_clip_range": ["-5", "5"],
    "advantage_estimator": ["reinforce_baseline"],
    "kl_estimator": ["k3"],
    "pretrain": ["/m/policy"],
    "remote_rm_url": ["http://rm:5000/get_reward"],
    "prompt_data": ["/d/prompts.jsonl"],
    "input_key": ["prompt"],
    "label_key": ["label"],
    "input_template": ["Q: {}"],
    "use_wandb": ["KEY"],
    "wandb_org": ["org"],
    "wandb_group": ["g"],
    "wandb_project": ["p"],
    "wandb_run_name": ["r"],
    "use_tensorboard": ["/tmp/tb"],
    "reward_pretrain": None,
    "critic_pretrain": None,
    "kl_target": None,
    "dual_clip": ["3"],
    "n_samples_per_prompt": ["4"],
    "rollout_batch_size": ["8"],
    "train_batch_size": ["32"],
    "micro_train_batch_size": ["4"],
    "micro_rollout_batch_size": ["4"],
    "vllm_num_engines": ["2"],
    "temperature": ["1.0"],
    "entropy_loss_coef": ["0.0"],
    "ptx_coef": ["0.05"],
    "eps_clip_low_high": ["0.2", "0.28"],
    "policy_loss_type": ["ppo"],
    "vllm_is_correction_type": ["icepop"],
    "vllm_is_truncated_threshold": ["0.5", "5.0"],
    "dynamic_filtering_reward_range": ["0", "1"],
    "adam_betas": ["0.9", "0.99"],
    "lr_scheduler": ["cosine_with_min_lr"],
    "l2": ["0.01"],
    "max_norm": ["0.5"],
    "value_head_prefix": ["value_head"],
    "prompt_data_probs": ["1.0"],
    "prompt_split": ["train"],
    "agent_func_path": ["/a/agent.py"],
    "eval_dataset": ["/d/eval.jsonl"],
    "eval_split": ["test"],
    "eval_steps": ["8"],
    "eval_temperature": ["0.6"],
    "eval_n_samples_per_prompt": ["4"],
    "best_metric_key": ["pass@1"],
    "overlong_buffer_len": ["16"],
    "overlong_penalty_factor": ["1.0"],
    "stop_properly_penalty_coef": ["0.5"],
    "grad_accum_dtype": ["fp32"],
    "max_ckpt_mem": ["20"],
    "dataloader_num_workers": ["2"],
}


def launch_line() -> list[str]:
    argv = []
    arity = native_arity()
    for flag in OPENRLHF_V0101_FLAGS:
        if VALUES.get(flag, 0) is None:
            continue
        if flag in UNSUPPORTED:
            spec = UNSUPPORTED[flag]
            if spec.nargs == 0 or spec.default is None:
                continue  # any use asks for the missing feature: covered by test_unsupported_refused_by_name
            argv += [f"--{flag}", *spec.default]
        elif flag in VALUES:
            argv += [f"--{flag}", *VALUES[flag]]
        elif arity.get(flag) == 0 or (flag in NO_EFFECT and NO_EFFECT[flag].nargs == 0):
            argv.append(f"--{flag}")
        else:
            argv += [f"--{flag}", "1"]
    return argv


def test_the_table_has_the_144_flags_once_and_knows_each():
    assert len(OPENRLHF_V0101_FLAGS) == 144 and len(set(OPENRLHF_V0101_FLAGS)) == 144
    ours = {name for _, name, _, _ in F.flag_fields()}
    for flag in OPENRLHF_V0101_FLAGS:
        kinds = [flag in ours, flag in ALIASES, flag in NO_EFFECT, flag in UNSUPPORTED]
        assert sum(kinds) == 1, f"--{flag}: exactly one of native/alias/no-effect/unsupported, got {kinds}"
    assert set(DOTTED.values()) <= set(OPENRLHF_V0101_FLAGS) | ours


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    return exit_.value.code, out.err


@pytest.mark.parametrize("dashed", [False, True])
def test_a_launch_line_with_every_flag_parses(capsys, no_training, dashed, monkeypatch):
    """Every flag is accepted and reaches the config. Cross-flag rules are off here: no single line can hold all
    144 validly (--vllm_enable_sleep excludes --async_train, in OpenRLHF too); test_config.py covers them."""
    import orlhf.config.validation

    monkeypatch.setattr(orlhf.config.validation, "validate", lambda cfg, explicit=(), local_packages=True: None)
    argv = launch_line()
    assert (
        len({t for t in argv if t.startswith("--")})
        == 144 - len([f for f, s in UNSUPPORTED.items() if s.nargs == 0 or s.default is None]) - 3
    )  # the VALUES None ones
    if dashed:
        argv = [t.replace("_", "-") if t.startswith("--") else t for t in argv]
    code, err = run(["train-ppo", *argv], capsys)
    assert code == 0, err
    (cfg,) = no_training
    assert cfg.deepspeed.bf16 and not cfg.deepspeed.flash_attn  # --param_dtype bf16, --attn_implementation sdpa
    assert cfg.ppo.max_len == 2048 and cfg.ppo.generate_max_len == 1024  # --max_new_tokens
    assert cfg.ppo.advantage_estimator == "reinforce_baseline" and cfg.ppo.reward_clip_range == (-5.0, 5.0)
    assert cfg.logging.wandb_org == "org" and cfg.logging.save_value_network and cfg.logging.use_wandb == "KEY"
    assert cfg.ppo.eps_clip_low_high == (0.2, 0.28) and cfg.ppo.adam_betas == (0.9, 0.99)  # loss variants
    assert cfg.ppo.vllm_is_correction_type == "icepop" and cfg.ppo.dynamic_filtering
    assert cfg.data.value_head_prefix == "value_head" and cfg.data.prompt_split == "train"  # data and heads
    assert cfg.data.agent_func_path == "/a/agent.py" and cfg.eval.eval_steps == 8  # agent and evaluation
    assert cfg.logging.use_ds_universal_ckpt  # implemented: tests/workers/test_universal_ckpt_mp.py
    assert cfg.vllm.sync_with_ray  # implemented: tests/vllm/test_engines.py, tests/unit/test_sync_with_ray.py
    ds = cfg.deepspeed  # the DeepSpeed and data knobs (tests/unit/test_openrlhf_knobs.py)
    assert ds.overlap_comm and ds.gradient_checkpointing_use_reentrant and ds.full_determinism and ds.use_liger_kernel
    assert (ds.grad_accum_dtype, ds.zpg, cfg.logging.max_ckpt_mem, cfg.data.dataloader_num_workers) == (
        "fp32",
        1,
        20,
        2,
    )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--ring_attn_size", "2"], "--ring_attn_size"),
        (["--load_in_4bit"], "--load_in_4bit"),  # without --lora_rank (and on CPU)
        (["--param_dtype", "fp16"], "--param_dtype fp16"),
        (["--ds.ring_attn_size", "4"], "--ring_attn_size"),
        (["--actor.muon.no_nesterov"], "--actor.muon.no_nesterov"),
    ],
)
def test_unsupported_refused_by_name(capsys, argv, flag):
    code, err = run(["train-ppo", *argv], capsys)
    assert code == 2 and flag in err and "Traceback" not in err
    if "ring_attn" in flag:
        assert "--ring_attn_size is OpenRLHF's; orlhf does not support it yet" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj", "--lora_dropout", "0.05"],
        ["--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "q_proj,v_proj", "--lora_dropout", "0.05"],
        [
            "--ds.lora.rank",
            "16",
            "--ds.lora.alpha",
            "32",
            "--ds.lora.target_modules",
            "q_proj",
            "v_proj",
            "--ds.lora.dropout",
            "0.05",
        ],
    ],
)
def test_lora_flags_in_every_spelling_reach_the_config(capsys, no_training, argv):
    code, err = run(["train-ppo", *argv], capsys)
    assert code == 0, err
    (cfg,) = no_training
    assert (cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.lora_dropout) == (16, 32, 0.05)
    assert cfg.lora.targets == ("q_proj", "v_proj") and cfg.reference_from_actor == cfg.has_reference


def test_lora_settings_without_a_rank_are_refused(capsys):
    code, err = run(["train-ppo", "--lora_alpha", "32", "--device", "cpu"], capsys)
    assert code == 2 and "--lora_alpha configure a LoRA adapter: add --lora_rank" in err


def test_every_unsupported_flag_is_refused_when_it_asks_for_its_feature():
    for flag, spec in UNSUPPORTED.items():
        value = [] if spec.nargs == 0 else ["7"] * (1 if spec.nargs < 0 else spec.nargs)
        with pytest.raises(CompatError, match=f"--{flag} is OpenRLHF's"):
            translate([f"--{flag}", *value], native_arity())


def test_dotted_names_reach_the_same_options(capsys, no_training, tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"input": "1+1="}\n')
    argv = [
        "--actor.model_name_or_path",
        str(tmp_path / "p"),
        "--data.prompt_dataset",
        str(tmp_path / "prompts.jsonl"),
        "--reward.remote_url",
        "http://rm:5000/get_reward",
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "4",
        "--ds.param_dtype",
        "bf16",
        "--rollout.max_new_tokens",
        "32",
        "--actor.adam.lr",
        "3e-6",
        "--logger.wandb.key",
        "--vllm.enforce_eager",
        "--ckpt.output_dir=/tmp/o",
        "--ds.use_universal_ckpt",
    ]
    code, err = run(["train-ppo", *argv], capsys)
    assert code == 0, err
    (cfg,) = no_training
    assert cfg.logging.use_ds_universal_ckpt
    assert cfg.data.pretrain == str(tmp_path / "p") and cfg.ppo.advantage_estimator == "group_norm"
    assert cfg.data.remote_rm_url == "http://rm:5000/get_reward"
    assert cfg.ppo.n_samples_per_prompt == 4 and cfg.deepspeed.bf16 and cfg.ppo.generate_max_len == 32
    assert cfg.ppo.actor_learning_rate == 3e-6 and cfg.logging.use_wandb == "" and cfg.vllm.enforce_eager
    assert cfg.logging.save_path == "/tmp/o"


@pytest.mark.parametrize(
    "argv",
    [
        ["--max_new_tokens", "64", "--generate_max_len", "32"],
        ["--attn_implementation", "sdpa", "--flash_attn"],
        ["--actor.model_name_or_path", "/a", "--pretrain", "/b"],
        ["--ref.offload", "--reward.offload", "--rollout.batch_size", "8", "--rollout_batch_size", "16"],
    ],
)
def test_one_option_two_spellings_two_values_is_an_error(capsys, argv):
    code, err = run(["train-ppo", *argv], capsys)
    assert code == 2 and "different values" in err, err


def test_same_value_under_two_spellings_is_fine(capsys, no_training):
    code, err = run(
        ["train-ppo", "--max_new_tokens", "64", "--generate-max-len", "64", "--param_dtype", "bf16", "--bf16"], capsys
    )
    assert code == 0, err
    assert no_training[0].ppo.generate_max_len == 64


def test_max_len_caps_prompt_plus_response(capsys, no_training):
    from orlhf.rollout.engine import SamplingSpec, max_new_tokens

    code, err = run(["train-ppo", "--max_len", "80"], capsys)  # demo: prompt_max_len 64
    assert code == 0, err
    p = no_training[0].ppo
    assert p.generate_max_len == 80  # only max_len caps, as in OpenRLHF without --max_new_tokens
    spec = SamplingSpec(max_new_tokens=p.generate_max_len, max_len=p.max_len)
    assert max_new_tokens(spec, 30) == 50 and max_new_tokens(spec, 64) == 16
    assert max_new_tokens(SamplingSpec(max_new_tokens=24), 60) == 24
    code, err = run(["train-ppo", "--max_len", "64"], capsys)
    assert code == 2 and "--max_len 64" in err and "--prompt_max_len" in err


PER_ROLE = [  # (OpenRLHF 0.11 name, value, TrainSlice field, expected value)
    ("max_norm", ["0.5"], "max_norm", 0.5),
    ("adam.betas", ["0.8", "0.9"], "adam_betas", (0.8, 0.9)),
    ("adam.eps", ["1e-6"], "adam_eps", 1e-6),
    ("adam.weight_decay", ["0.01"], "weight_decay", 0.01),
    ("lr_scheduler", ["linear"], "lr_scheduler", "linear"),
    ("lr_warmup_ratio", ["0.2"], "lr_warmup_ratio", 0.2),
    ("min_lr_ratio", ["0.3"], "min_lr_ratio", 0.3),
]


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("name, value, field, expected", PER_ROLE, ids=[p[0] for p in PER_ROLE])
def test_a_per_role_optimizer_flag_reaches_its_role_only(capsys, no_training, role, name, value, field, expected):
    from orlhf.config.resolve import resolve_demo
    from orlhf.config.worker_config import worker_config

    code, err = run(
        ["train-ppo", "--device", "cpu", "--advantage_estimator", "gae", f"--{role}.{name}", *value], capsys
    )
    assert code == 0, err
    (cfg,) = no_training
    cfg = resolve_demo(cfg)
    other = "critic" if role == "actor" else "actor"
    mine, theirs = worker_config(cfg, role).train, worker_config(cfg, other).train
    assert getattr(mine, field) == expected
    assert getattr(theirs, field) == getattr(worker_config(resolve_demo(no_training_default(cfg)), other).train, field)


def no_training_default(cfg):
    """The same run without any per-role optimizer flag."""
    import dataclasses

    from orlhf.config.train_config import RoleOptimConfig

    return dataclasses.replace(cfg, optim=RoleOptimConfig())


def test_flat_optimizer_flags_keep_their_meaning_for_both_roles(capsys, no_training):
    from orlhf.config.resolve import resolve_demo
    from orlhf.config.worker_config import worker_config

    argv = ["train-ppo", "--device", "cpu", "--advantage_estimator", "gae", "--max_norm", "0.7", "--l2", "0.1"]
    code, err = run([*argv, "--critic.max_norm", "0.5"], capsys)
    assert code == 0, err
    cfg = resolve_demo(no_training[0])
    actor, critic = worker_config(cfg, "actor").train, worker_config(cfg, "critic").train
    assert (actor.max_norm, critic.max_norm) == (0.7, 0.5)  # --critic.max_norm alone changes the critic only
    assert actor.weight_decay == critic.weight_decay == 0.1


def test_a_bad_per_role_value_names_its_own_flag(capsys):
    code, err = run(["train-ppo", "--device", "cpu", "--critic.max_norm", "-1"], capsys)
    assert code == 2 and "--critic_max_norm must be >= 0 (got -1.0" in err and "--max_norm must" not in err


def test_attn_implementation_eager_loads_eager_attention(capsys, no_training):
    from orlhf.config.resolve import resolve_demo
    from orlhf.config.worker_config import worker_config
    from orlhf.workers.loading import hf_load_kwargs

    code, err = run(["train-ppo", "--device", "cpu", "--attn_implementation", "eager"], capsys)
    assert code == 0, err
    cfg = resolve_demo(no_training[0])
    assert cfg.deepspeed.eager_attention and not cfg.deepspeed.flash_attn
    assert hf_load_kwargs(worker_config(cfg, "actor"))["attn_implementation"] == "eager"
    code, err = run(["train-ppo", "--device", "cpu", "--attn_implementation", "flex_attention"], capsys)
    assert code == 2 and "orlhf runs flash_attention_2 (--flash_attn), sdpa (the default) or eager" in err
