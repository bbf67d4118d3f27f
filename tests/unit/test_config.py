"""Every cross-flag rule of config/validation: a valid combination passes, an invalid one fails naming its flags."""

import dataclasses

import pytest

from orlhf.config.flags import DEMO_PRESET, build_config
from orlhf.config.train_config import ConfigError, TrainConfig


def build(**flags) -> TrainConfig:
    return build_config(flags, explicit=set(flags))


def problems(**flags) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build(**flags)
    return err.value.problems


def assert_fails(fragments, **flags):
    """The flags fail, and one problem mentions every fragment (flag names, the fix)."""
    found = problems(**flags)
    assert any(all(f in p for f in fragments) for p in found), found


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"input": "hi"}\n')
    return str(p)


@pytest.fixture
def reward_py(tmp_path):
    p = tmp_path / "r.py"
    p.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    return str(p)


def test_defaults_are_valid_and_frozen():
    cfg = build()
    assert cfg.data.uses_demo and cfg.has_critic and not cfg.has_reward_model
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ppo.eps_clip = 0.3  # type: ignore[misc]


def test_demo_preset_fills_only_unset_flags():
    cfg = build_config({"generate_max_len": 7}, explicit={"generate_max_len"})
    assert cfg.ppo.generate_max_len == 7  # the user's value wins
    assert cfg.ppo.prompt_max_len == DEMO_PRESET["prompt_max_len"]


def test_no_preset_with_pretrain(model_dir, prompts, reward_py):
    cfg = build(pretrain=model_dir, prompt_data=prompts, remote_rm_url=reward_py)
    assert cfg.ppo.generate_max_len == 1024 and cfg.data.input_key == "input"


@pytest.mark.parametrize("est", ["rloo", "reinforce_baseline", "group_norm", "dr_grpo"])
def test_group_estimators_need_several_samples(est):
    assert_fails(["--advantage_estimator " + est, "--n_samples_per_prompt"], advantage_estimator=est)
    cfg = build(advantage_estimator=est, n_samples_per_prompt=4, rollout_batch_size=16)
    assert not cfg.has_critic


def test_group_estimators_need_gamma_1():
    assert_fails(
        ["--advantage_estimator rloo", "--gamma 1.0"], advantage_estimator="rloo", n_samples_per_prompt=2, gamma=0.9
    )


def test_reinforce_needs_one_sample_only():
    assert not build(advantage_estimator="reinforce").has_critic


def test_flash_reinforce_takes_one_sample_per_prompt_and_gamma_1():
    """OpenRLHF 0.11.2's flash_reinforce: no group (one sample per prompt is its regime), no critic; its baseline is on
    the final score, so a discount is refused (0.11.2 rewrites --gamma to 1 with a warning)."""
    cfg = build(advantage_estimator="flash_reinforce")
    assert cfg.ppo.n_samples_per_prompt == 1 and not cfg.has_critic
    est = "flash_reinforce"
    assert_fails(["--advantage_estimator flash_reinforce", "--gamma 1.0"], advantage_estimator=est, gamma=0.9)
    assert_fails(
        ["--no_advantage_std_norm", "not whitened"], advantage_estimator="flash_reinforce", no_advantage_std_norm=True
    )


def test_critic_only_with_gae(model_dir):
    assert_fails(["--critic_pretrain", "gae"], advantage_estimator="reinforce", critic_pretrain=model_dir)
    assert_fails(["--colocate_critic_reward", "gae"], advantage_estimator="reinforce", colocate_critic_reward=True)
    assert build(critic_pretrain=model_dir).has_critic


def test_estimator_registry_drives_cli_choices_and_validation(monkeypatch):
    """algo/registry.py is the one table: the flag's choices are its keys, and a new row (here a made-up grouped
    estimator with a critic) gets the group rules, the critic and its placement with no other edit."""
    from orlhf.algo import registry
    from orlhf.cli import main
    from orlhf.config.flags import flag_fields
    from orlhf.config.roles import active_roles, trained_roles

    choices = next(f.metadata["choices"] for _, name, f, _ in flag_fields() if name == "advantage_estimator")
    assert choices == tuple(registry.ESTIMATORS)
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--advantage_estimator", "not_an_estimator"])
    assert exit_.value.code == 2
    monkeypatch.setitem(
        registry.ESTIMATORS, "grouped_gae", registry.EstimatorSpec(needs_critic=True, baseline="mean", whiten=False)
    )
    assert_fails(["--advantage_estimator grouped_gae", "--n_samples_per_prompt"], advantage_estimator="grouped_gae")
    assert_fails(
        ["--no_advantage_std_norm", "not whitened"],
        advantage_estimator="grouped_gae",
        n_samples_per_prompt=2,
        no_advantage_std_norm=True,
    )
    cfg = build(advantage_estimator="grouped_gae", n_samples_per_prompt=2)
    assert cfg.has_critic and "critic" in active_roles(cfg) and trained_roles(cfg) == ["actor", "critic"]
    assert "unknown" not in " ".join(problems(advantage_estimator="reinforce", n_samples_per_prompt=0))
    assert_fails(["--advantage_estimator 'bogus'", "gae"], advantage_estimator="bogus")


def test_exactly_one_reward_source(model_dir, prompts, reward_py):
    assert_fails(
        ["--reward_pretrain", "--remote_rm_url", "choose one"],
        pretrain=model_dir,
        prompt_data=prompts,
        reward_pretrain=model_dir,
        remote_rm_url=reward_py,
    )
    assert_fails(["--pretrain", "--reward_pretrain", "--remote_rm_url"], pretrain=model_dir, prompt_data=prompts)
    assert build(pretrain=model_dir, prompt_data=prompts, reward_pretrain=model_dir).has_reward_model
    assert build(pretrain=model_dir, prompt_data=prompts, remote_rm_url="http://127.0.0.1:5000/get_reward")


def test_pretrain_needs_prompt_data(model_dir, reward_py):
    assert_fails(["--prompt_data"], pretrain=model_dir, remote_rm_url=reward_py)


def test_colocate_all_models_needs_engines_to_cover_actor_gpus():
    assert_fails(
        ["--colocate_all_models", "vllm_num_engines x vllm_tensor_parallel_size", "actor 4"],
        colocate_all_models=True,
        actor_num_gpus_per_node=4,
        ref_num_gpus_per_node=4,
        critic_num_gpus_per_node=4,
        vllm_num_engines=1,
        train_batch_size=64,
    )
    cfg = build(
        colocate_all_models=True,
        actor_num_gpus_per_node=4,
        ref_num_gpus_per_node=4,
        critic_num_gpus_per_node=4,
        vllm_num_engines=2,
        vllm_tensor_parallel_size=2,
    )
    assert cfg.placement.colocate_all_models


def test_colocate_all_models_needs_same_shapes():
    assert_fails(
        ["--colocate_all_models", "--ref_num_nodes"],
        colocate_all_models=True,
        actor_num_gpus_per_node=2,
        vllm_num_engines=2,
        critic_num_gpus_per_node=2,
    )


def test_colocate_all_tp_engine_on_one_node():
    assert_fails(
        ["--vllm_tensor_parallel_size 4", "--actor_num_gpus_per_node 2"],
        colocate_all_models=True,
        actor_num_nodes=2,
        actor_num_gpus_per_node=2,
        ref_num_nodes=2,
        ref_num_gpus_per_node=2,
        critic_num_nodes=2,
        critic_num_gpus_per_node=2,
        vllm_num_engines=1,
        vllm_tensor_parallel_size=4,
    )


def test_colocate_actor_ref_needs_equal_shapes():
    assert_fails(["--colocate_actor_ref", "actor 1x2", "ref 1x1"], colocate_actor_ref=True, actor_num_gpus_per_node=2)
    assert build(colocate_actor_ref=True, actor_num_gpus_per_node=2, ref_num_gpus_per_node=2)


def test_colocate_critic_reward(model_dir, prompts):
    base = dict(pretrain=model_dir, prompt_data=prompts, reward_pretrain=model_dir, colocate_critic_reward=True)
    assert_fails(["--colocate_critic_reward", "critic 1x2", "reward 1x1"], critic_num_gpus_per_node=2, **base)
    assert build(critic_num_gpus_per_node=2, reward_num_gpus_per_node=2, **base)
    assert_fails(["--colocate_critic_reward", "--reward_pretrain"], colocate_critic_reward=True)


def test_vllm_sleep_rules():
    assert_fails(["--vllm_enable_sleep", "--colocate_all_models"], vllm_enable_sleep=True)
    hybrid = dict(colocate_all_models=True, vllm_enable_sleep=True)
    assert_fails(["--vllm_enable_sleep", "--async_train"], async_train=True, **hybrid)
    assert build(deepspeed_enable_sleep=True, **hybrid).vllm.enable_sleep
    assert_fails(["--deepspeed_enable_sleep", "--colocate_all_models"], deepspeed_enable_sleep=True)


def test_vllm_generate_batch_size_over_samples_into_the_async_queue_only():
    ok = dict(async_train=True, async_queue_size=2, rollout_batch_size=32, train_batch_size=32)
    assert build(vllm_generate_batch_size=64, **ok).ppo.vllm_generate_batch_size == 64
    assert_fails(["--vllm_generate_batch_size 48 must be a multiple"], vllm_generate_batch_size=48, **ok)
    assert_fails(["add --async_train"], vllm_generate_batch_size=64, rollout_batch_size=32, train_batch_size=32)
    assert_fails(["--async_queue_size must be >= 3"], vllm_generate_batch_size=96, **ok)


def test_async_train_with_colocate_all_colocates_the_deepspeed_models_only():
    """As OpenRLHF's async mode: the engines keep devices of their own (so their count is free), the DeepSpeed
    models share the actor's; --deepspeed_enable_sleep then keeps the trainers' states off the devices outside their
    training (trainer/hybrid_memory.py), as OpenRLHF accepts it."""
    cfg = build(async_train=True, colocate_all_models=True, vllm_num_engines=3)
    assert cfg.placement.colocate_all_models and not cfg.engines_colocated
    assert build(colocate_all_models=True).engines_colocated
    assert build(async_train=True, colocate_all_models=True, deepspeed_enable_sleep=True).deepspeed.enable_sleep
    assert build(async_train=True, async_queue_size=2).ppo.async_train


def test_train_batch_divides_by_micro_batch_times_ranks():
    # 64 % (16 x 3) != 0
    assert_fails(
        ["--train_batch_size 64", "--micro_train_batch_size", "actor ranks", "16 x 3 = 48"],
        actor_num_gpus_per_node=3,
        micro_train_batch_size=16,
    )
    assert_fails(["critic ranks"], critic_num_nodes=3, micro_train_batch_size=8)
    assert build(actor_num_gpus_per_node=2, critic_num_gpus_per_node=4, micro_train_batch_size=8)
    # no critic without gae: its rank count does not matter then
    assert build(advantage_estimator="reinforce", critic_num_nodes=3, micro_train_batch_size=8)


def test_rollout_samples_divide_into_train_batches():
    assert_fails(
        ["--rollout_batch_size x --n_samples_per_prompt", "--train_batch_size 64"],
        rollout_batch_size=48,
        train_batch_size=64,
    )
    assert build(rollout_batch_size=48, n_samples_per_prompt=4, train_batch_size=64, advantage_estimator="group_norm")


def test_paths_must_exist(tmp_path, prompts, reward_py, monkeypatch):
    assert_fails(
        ["--pretrain", "no such folder"], pretrain=str(tmp_path / "nope"), prompt_data=prompts, remote_rm_url=reward_py
    )
    (tmp_path / "empty").mkdir()
    assert_fails(
        ["--pretrain", "config.json"], pretrain=str(tmp_path / "empty"), prompt_data=prompts, remote_rm_url=reward_py
    )
    assert_fails(["--prompt_data", "no such file"], prompt_data=str(tmp_path / "missing.jsonl"))
    assert_fails(["--remote_rm_url", "no such file"], remote_rm_url=str(tmp_path / "missing.py"))
    assert_fails(["--remote_rm_url", "http(s)://"], remote_rm_url=str(prompts))
    assert_fails(["--reward_pretrain", "is a file"], reward_pretrain=prompts)
    # a hub id is allowed only while the hub is reachable
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert build(pretrain="org/model", prompt_data=prompts, remote_rm_url=reward_py)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_fails(
        ["--pretrain org/model", "HF_HUB_OFFLINE"], pretrain="org/model", prompt_data=prompts, remote_rm_url=reward_py
    )


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ({"eps_clip": 0.0}, "--eps_clip must be > 0"),
        ({"lambd": 1.5}, "--lambd must be in [0, 1]"),
        ({"gamma": -0.1}, "--gamma must be in [0, 1]"),
        ({"value_clip": 0.0}, "--value_clip must be > 0"),
        ({"dual_clip": 1.0}, "--dual_clip must be > 1"),
        ({"actor_learning_rate": 0.0}, "--actor_learning_rate must be > 0"),
        ({"critic_learning_rate": -1.0}, "--critic_learning_rate must be > 0"),
        ({"lr_warmup_ratio": 1.0}, "--lr_warmup_ratio must be in [0, 1)"),
        ({"init_kl_coef": -0.1}, "--init_kl_coef must be >= 0"),
        ({"kl_target": 0.0}, "--kl_target must be > 0"),
        ({"entropy_loss_coef": -1.0}, "--entropy_loss_coef must be >= 0"),
        ({"temperature": 0.0}, "--temperature must be > 0"),
        ({"top_p": 0.0}, "--top_p must be in (0, 1]"),
        ({"reward_clip_range": (5.0, -5.0)}, "--reward_clip_range LOW HIGH needs LOW < HIGH"),
        ({"vllm_gpu_memory_utilization": 1.5}, "--vllm_gpu_memory_utilization must be in (0, 1]"),
        ({"vllm_num_engines": -1}, "--vllm_num_engines must be >= 0"),
        ({"actor_num_nodes": 0}, "--actor_num_nodes must be >= 1"),
        ({"num_episodes": 0}, "--num_episodes must be >= 1"),
        ({"max_samples": 0}, "--max_samples must be >= 1"),
        ({"save_steps": 0}, "--save_steps must be -1 (never) or >= 1"),
        ({"input_template": "no placeholder"}, "--input_template must contain exactly one '{}'"),
        ({"async_queue_size": 0}, "--async_queue_size must be >= 1"),
        ({"vllm_cpu_threads": -1}, "--vllm_cpu_threads must be >= 0"),
        ({"train_cpu_threads": -2}, "--train_cpu_threads must be >= 0"),
    ],
)
def test_value_ranges(flags, fragment):
    assert any(fragment in p for p in problems(**flags)), problems(**flags)


def test_cpu_device_rules():
    assert_fails(["--vllm_sync_backend nccl", "gloo"], device="cpu", vllm_sync_backend="nccl")
    assert_fails(["--flash_attn", "CUDA"], device="cpu", flash_attn=True)
    assert build(device="cpu", vllm_sync_backend="gloo").vllm.sync_backend == "gloo"
    assert build(device="cuda", vllm_sync_backend="nccl")


def test_padding_and_thread_flags_reach_the_workers_and_engines():
    from dataclasses import replace

    from orlhf.config.worker_config import worker_config
    from orlhf.rollout.engine_config import engine_config

    cfg = build(no_trim_padding=True, packing_samples=True, train_cpu_threads=2, vllm_cpu_threads=3, device="cpu")
    cfg = replace(cfg, data=replace(cfg.data, pretrain="model"))  # as config.resolve.resolve_demo fills it in
    w = worker_config(cfg, "ref")
    assert (w.trim_padding, w.packing_samples, w.cpu_threads) == (False, True, 2)
    assert engine_config(cfg).cpu_threads == 3
    default = worker_config(replace(cfg, deepspeed=type(cfg.deepspeed)()), "actor")
    assert (default.trim_padding, default.packing_samples, default.cpu_threads) == (True, False, 0)


def test_reference_and_old_log_prob_forwards_only_where_they_can_change_the_update():
    demo = build()  # KL 0.01 shaped into the rewards from the old log-probs: both forwards needed
    assert demo.has_reference and not demo.single_pass
    no_kl = build(init_kl_coef=0.0)  # demo preset: 64 prompts x 1 sample = one train batch of 64
    assert not no_kl.has_reference and no_kl.single_pass
    assert build(use_kl_loss=True).single_pass  # the KL loss reads the current log-probs, not pi_old
    assert not build(use_kl_loss=True, kl_target=0.1).single_pass  # the adaptive controller reads KL(old || ref)
    assert build(init_kl_coef=0.0, use_kl_loss=True).has_reference
    assert not build(init_kl_coef=0.0, max_epochs=2).single_pass  # epoch 2 moves away from pi_old
    # 64 x 4 = 256 samples: one optimizer step with train_batch 256, four with 64 (steps 2-4 start moved)
    group = dict(init_kl_coef=0.0, advantage_estimator="group_norm", n_samples_per_prompt=4)
    assert build(**group, train_batch_size=256).single_pass
    assert not build(**group, train_batch_size=64).single_pass


def test_all_problems_reported_at_once():
    found = problems(eps_clip=-1.0, top_p=2.0, advantage_estimator="rloo")
    assert len(found) == 3


def test_unknown_flag_is_a_programming_error():
    with pytest.raises(KeyError):
        build_config({"not_a_flag": 1})


@pytest.mark.parametrize("template", ['{"question": {}}', "Q: {} {name}", "{0} and {}", "Q: {}}"])
def test_input_template_with_other_braces_is_one_flag_error(template):
    with pytest.raises(ConfigError) as e:
        build_config({"input_template": template}, {"input_template"})
    (problem,) = e.value.problems
    assert problem.startswith(f"--input_template {template!r}: braces other than") and "'{{' and '}}'" in problem
    build_config({"input_template": '{{"question": {}}}'}, {"input_template"})  # doubled braces format fine


def test_allow_no_checkpoint_needs_load_checkpoint_and_reward_timeout_positive():
    with pytest.raises(ConfigError) as e:
        build_config({"allow_no_checkpoint": True, "reward_timeout_s": 0.0}, {"allow_no_checkpoint"})
    assert any("--allow_no_checkpoint only applies with --load_checkpoint" in p for p in e.value.problems)
    assert any("--reward_timeout_s must be > 0" in p for p in e.value.problems)


def test_checkpoints_default_under_the_run_folder():
    cfg = build_config({"save_path": "/runs/a"}, {"save_path"})
    assert cfg.logging.checkpoint_dir == "/runs/a/checkpoints_ppo"
    cfg = build_config({"save_path": "/runs/a", "ckpt_path": "/ck"}, {"save_path", "ckpt_path"})
    assert cfg.logging.checkpoint_dir == "/ck"


def test_prompt_mix_and_value_head_flags(model_dir, prompts, reward_py, tmp_path):
    other = tmp_path / "q.jsonl"
    other.write_text('{"input": "ho"}\n')
    base = dict(pretrain=model_dir, remote_rm_url=reward_py)
    cfg = build(
        **base,
        prompt_data=f"{prompts},{other}",
        prompt_data_probs="0.7,0.3",
        prompt_split="test",
        value_head_prefix="value_head",
    )
    assert (cfg.data.prompt_data_probs, cfg.data.prompt_split, cfg.data.value_head_prefix) == (
        "0.7,0.3",
        "test",
        "value_head",
    )
    assert build(**base, prompt_data=prompts).data.value_head_prefix == "score"  # OpenRLHF's default
    found = problems(
        **base,
        prompt_data=f"{prompts},{tmp_path}/missing.jsonl",
        prompt_data_probs="0.7",
        value_head_prefix="a.b",
        prompt_split=" ",
    )
    for fragment in (
        "missing.jsonl: no such file or folder",
        "--prompt_data_probs 0.7: 1 values for 2 --prompt_data sources",
        "--value_head_prefix 'a.b' must be a module name",
        "--prompt_split must name a split",
    ):
        assert any(fragment in p for p in found), (fragment, found)
    assert_fails(
        ["--prompt_data_probs 0.6,0.3", "sum to 0.9"],
        **base,
        prompt_data=f"{prompts},{other}",
        prompt_data_probs="0.6,0.3",
    )
    assert_fails(["--prompt_data_probs needs --prompt_data"], prompt_data_probs="1.0")


def test_value_head_flags_reach_the_reward_and_critic_workers(model_dir, prompts):
    from orlhf.config.worker_config import worker_config

    cfg = build(
        pretrain=model_dir,
        reward_pretrain=model_dir,
        prompt_data=prompts,
        value_head_prefix="value_head",
        normalize_reward=True,
        device="cpu",
    )
    for role in ("reward", "critic"):
        w = worker_config(cfg, role)
        assert (w.head.value_head_prefix, w.head.normalize_reward) == ("value_head", True), role


# ---------------------------------------------------------------- losses, DAPO / GSPO, IS correction, optimizer


def _actor(cfg):
    from dataclasses import replace

    from orlhf.config.resolve import resolve_device
    from orlhf.config.worker_config import worker_config

    return worker_config(resolve_device(replace(cfg, data=replace(cfg.data, pretrain="model")), "cpu"), "actor")


def test_loss_flags_reach_the_actor_slice():
    w = _actor(
        build(
            eps_clip_low_high=(0.2, 0.28),
            enable_vllm_is_correction=True,
            vllm_is_correction_type="icepop",
            vllm_is_truncated_threshold=(0.3, 3.0),
            max_norm=0.5,
            adam_betas=(0.9, 0.99),
            l2=0.01,
            lr_scheduler="linear",
        )
    )
    loss, t = w.loss, w.train
    assert (loss.eps_clip, loss.eps_clip_high, loss.is_correction, loss.is_threshold) == (
        0.2,
        0.28,
        "icepop",
        (0.3, 3.0),
    )
    assert (t.max_norm, t.adam_betas, t.weight_decay, t.lr_scheduler) == (0.5, (0.9, 0.99), 0.01, "linear")
    assert loss.loss_agg_mode == "token_mean" and loss.policy_loss_type == "ppo"
    plain = _actor(build(eps_clip=0.3)).loss
    assert (plain.eps_clip, plain.eps_clip_high, plain.is_correction) == (0.3, 0.3, None)
    # GSPO defaults to the sequence mean (OpenRLHF); an explicit --loss_agg_mode wins.
    assert _actor(build(policy_loss_type="gspo")).loss.loss_agg_mode == "seq_mean"
    assert _actor(build(policy_loss_type="gspo", loss_agg_mode="token_mean")).loss.loss_agg_mode == "token_mean"


def test_config_choices_match_the_algo_registries():
    from orlhf.algo import losses
    from orlhf.config import ppo_config as config

    assert config.LOSS_AGG_MODES == losses.LOSS_AGG_MODES
    assert config.POLICY_LOSS_TYPES == losses.POLICY_LOSS_TYPES
    assert config.IS_CORRECTION_TYPES == losses.IS_CORRECTION_TYPES


def test_dynamic_filtering_rules(model_dir, prompts):
    assert_fails(["--dynamic_filtering", "--n_samples_per_prompt"], dynamic_filtering=True)
    assert_fails(
        ["--dynamic_filtering_reward_range", "LOW < HIGH"],
        dynamic_filtering=True,
        n_samples_per_prompt=2,
        advantage_estimator="group_norm",
        dynamic_filtering_reward_range=(1.0, 0.0),
    )
    assert_fails(
        ["--dynamic_filtering", "--reward_pretrain"],
        dynamic_filtering=True,
        n_samples_per_prompt=2,
        pretrain=model_dir,
        reward_pretrain=model_dir,
        prompt_data=prompts,
    )
    build(dynamic_filtering=True, n_samples_per_prompt=4, advantage_estimator="group_norm")
    # async: the producer fills each queued batch through the filter (trainer/async_producer.py)
    assert build(dynamic_filtering=True, n_samples_per_prompt=2, async_train=True).ppo.async_train


@pytest.mark.parametrize(
    "flags,fragments",
    [
        (dict(eps_clip_low_high=(0.0, 0.28)), ["--eps_clip_low_high"]),
        (dict(vllm_is_truncated_threshold=(5.0, 0.5)), ["--vllm_is_truncated_threshold"]),
        (
            dict(policy_loss_type="gspo", enable_vllm_is_correction=True, vllm_is_correction_type="icepop"),
            ["--vllm_is_correction_type icepop", "--policy_loss_type gspo"],
        ),
        (dict(use_kl_loss=True, kl_target=0.1, init_kl_coef=0.0), ["--kl_target", "--init_kl_coef"]),
        (dict(max_norm=-1.0), ["--max_norm"]),
        (dict(adam_betas=(0.9, 1.0)), ["--adam_betas"]),
        (dict(l2=-0.1), ["--l2"]),
        (dict(lr_scheduler="constant", lr_warmup_ratio=0.1), ["--lr_scheduler constant", "--lr_warmup_ratio"]),
        (
            dict(no_advantage_std_norm=True, advantage_estimator="group_norm", n_samples_per_prompt=2),
            ["--no_advantage_std_norm", "--advantage_estimator group_norm", "dr_grpo"],
        ),
        (dict(overlong_buffer_len=30.0, generate_max_len=24), ["--overlong_buffer_len", "--generate_max_len"]),
        (dict(stop_properly_penalty_coef=1.5), ["--stop_properly_penalty_coef"]),
    ],
)
def test_loss_variant_rules(flags, fragments):
    assert_fails(fragments, **flags)


def test_valid_dapo_and_gspo_combinations():
    build(
        advantage_estimator="group_norm",
        n_samples_per_prompt=4,
        eps_clip_low_high=(0.2, 0.28),
        dynamic_filtering=True,
        overlong_buffer_len=8.0,
        overlong_penalty_factor=1.0,
        stop_properly_penalty_coef=0.0,
    )
    build(
        advantage_estimator="group_norm",
        n_samples_per_prompt=4,
        policy_loss_type="gspo",
        enable_vllm_is_correction=True,
    )
    build(no_advantage_std_norm=True, advantage_estimator="reinforce_baseline", n_samples_per_prompt=2)


@pytest.mark.parametrize(
    "flags,needs",
    [
        (dict(vllm_is_correction_type="icepop"), "--enable_vllm_is_correction"),
        (dict(vllm_is_truncated_threshold=(0.4, 4.0)), "--enable_vllm_is_correction"),
        (dict(dynamic_filtering_reward_range=(0.0, 1.0)), "--dynamic_filtering"),
        (dict(overlong_penalty_factor=0.5), "--overlong_buffer_len"),
    ],
)
def test_a_flag_given_without_the_flag_it_needs_is_refused(flags, needs):
    (flag,) = flags
    assert_fails([f"--{flag}", needs, "does nothing"], **flags)
    # the same values as defaults (the flag not given) pass: only an explicit flag counts
    build_config(flags, explicit=set())


def test_the_needed_flag_makes_them_valid():
    build(vllm_is_correction_type="icepop", vllm_is_truncated_threshold=(0.4, 4.0), enable_vllm_is_correction=True)
    build(
        dynamic_filtering_reward_range=(0.0, 1.0),
        dynamic_filtering=True,
        n_samples_per_prompt=2,
        advantage_estimator="group_norm",
    )
    build(overlong_penalty_factor=0.5, overlong_buffer_len=4.0)


def test_eps_clip_and_eps_clip_low_high_together_are_refused():
    assert_fails(["--eps_clip and --eps_clip_low_high", "only one"], eps_clip=0.2, eps_clip_low_high=(0.2, 0.28))
    build(eps_clip_low_high=(0.2, 0.28))  # --eps_clip at its default: fine
    build(eps_clip=0.3)


def test_gspo_with_is_correction_refuses_a_type_or_threshold():
    """OpenRLHF v0.10.1's GSPO puts the engine log-probs in its sequence ratio and applies neither the correction
    type nor the threshold, so both would be silently ignored."""
    gspo = dict(policy_loss_type="gspo", enable_vllm_is_correction=True)
    assert_fails(
        ["--vllm_is_truncated_threshold 0.4 4.0", "--policy_loss_type gspo"],
        **gspo,
        vllm_is_truncated_threshold=(0.4, 4.0),
    )
    assert_fails(["--vllm_is_correction_type tis", "--policy_loss_type gspo"], **gspo, vllm_is_correction_type="tis")
    build(**gspo)
    build(policy_loss_type="ppo", enable_vllm_is_correction=True, vllm_is_truncated_threshold=(0.4, 4.0))


def test_demo_preset_and_the_e2e_flag_sets_pass_the_given_together_rules():
    """No preset value counts as given, and the flag sets the e2e tests and benchmarks run with stay valid."""
    assert not set(DEMO_PRESET) & {
        "vllm_is_correction_type",
        "vllm_is_truncated_threshold",
        "eps_clip",
        "dynamic_filtering_reward_range",
        "overlong_penalty_factor",
    }
    build()
    # tests/e2e/test_train_ppo.py's DAPO-style GSPO run
    build(
        advantage_estimator="group_norm",
        n_samples_per_prompt=4,
        policy_loss_type="gspo",
        eps_clip_low_high=(0.2, 0.28),
        dynamic_filtering=True,
        overlong_buffer_len=4.0,
        overlong_penalty_factor=0.1,
    )


def test_agent_file_replaces_the_reward_source(model_dir, prompts, reward_py, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("")
    cfg = build(pretrain=model_dir, prompt_data=prompts, agent_func_path=str(agent))
    assert cfg.data.agent_func_path == str(agent) and not cfg.has_reward_model
    assert_fails(
        ["--agent_func_path", "--remote_rm_url", "drop --remote_rm_url"],
        pretrain=model_dir,
        prompt_data=prompts,
        agent_func_path=str(agent),
        remote_rm_url=reward_py,
    )
    assert_fails(
        ["--agent_func_path", "--reward_pretrain"],
        pretrain=model_dir,
        prompt_data=prompts,
        agent_func_path=str(agent),
        reward_pretrain=model_dir,
    )
    assert_fails(["--agent_func_path", "missing.py", ".py file"], agent_func_path=str(tmp_path / "missing.py"))


def test_eval_rules(prompts):
    cfg = build(eval_dataset=prompts, eval_steps=5, eval_n_samples_per_prompt=2, best_metric_key="pass@k")
    assert (cfg.eval.eval_steps, cfg.eval.eval_n_samples_per_prompt, cfg.eval.best_metric_key) == (5, 2, "pass@k")
    assert_fails(["--eval_steps", "needs --eval_dataset"], eval_steps=5)
    assert_fails(["--best_metric_key", "needs --eval_dataset"], best_metric_key="pass@1")
    assert_fails(["--eval_before_train", "needs --eval_dataset"], eval_before_train=True)
    assert build(eval_dataset=prompts, eval_before_train=True).eval.eval_before_train
    assert_fails(["--eval_steps must be -1"], eval_dataset=prompts, eval_steps=0)
    assert_fails(["--eval_n_samples_per_prompt must be >= 1"], eval_dataset=prompts, eval_n_samples_per_prompt=0)
    assert_fails(["--eval_dataset", "no such file"], eval_dataset="nowhere/at_all.jsonl")


@pytest.mark.parametrize(
    "key, metric",
    [
        ("pass@k", "pass@k"),
        ("eval/reward_mean", "reward_mean"),
        ("eval_default_pass1", "pass@1"),  # OpenRLHF's README form: eval_<dataset>_pass1
        ("eval_math_pass2", "pass@k"),  # eval_<dataset>_pass<k>, k = --eval_n_samples_per_prompt
        ("", "pass@1"),  # OpenRLHF's default: its first pass1 metric
        ("none", None),  # OpenRLHF's off
    ],
)
def test_best_metric_key_takes_openrlhf_values(prompts, key, metric):
    cfg = build(eval_dataset=prompts, eval_n_samples_per_prompt=2, best_metric_key=key)
    assert cfg.eval.best_metric == metric


def test_best_metric_key_openrlhf_default_and_off_need_no_eval_dataset():
    assert build(best_metric_key="").eval.best_metric is None
    assert build(best_metric_key="none").eval.best_metric is None
    assert_fails(
        ["--best_metric_key eval_default_pass3: not an evaluation metric", "pass@1 or pass@k"],
        best_metric_key="eval_default_pass3",
    )


def test_dynamic_batch_and_freezing_rules():
    assert_fails(["--train_max_tokens_per_gpu must be >= 1"], use_dynamic_batch=True, train_max_tokens_per_gpu=0)
    assert_fails(["--rollout_max_tokens_per_gpu must be >= 1"], rollout_max_tokens_per_gpu=-5)
    assert_fails(
        ["--freezing_actor_steps", "no critic", "gae"], advantage_estimator="reinforce", freezing_actor_steps=2
    )
    assert_fails(["--freezing_actor_steps must be >= -1"], freezing_actor_steps=-2)
    # a budget below prompt + response is no error (OpenRLHF has none): long samples run alone
    cfg = build(
        use_dynamic_batch=True,
        train_max_tokens_per_gpu=8,
        prompt_max_len=64,
        generate_max_len=64,
        freezing_actor_steps=1,
        disable_ds_ckpt=True,
    )
    assert cfg.deepspeed.train_max_tokens_per_gpu == 8 and cfg.ppo.freezing_actor_steps == 1


def test_dynamic_batch_budgets_reach_the_workers():
    from orlhf.config.worker_config import worker_config

    def of(role, **flags):
        cfg = build(device="cpu", **flags)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain="/m"))  # as resolve_demo does
        return worker_config(cfg, role)

    actor, ref = (
        of("actor", use_dynamic_batch=True, train_max_tokens_per_gpu=100),
        of("ref", use_dynamic_batch=True, train_max_tokens_per_gpu=100),
    )
    assert (actor.train.max_tokens, actor.forward_max_tokens, ref.forward_max_tokens) == (100, 100, 100)
    critic = of("critic", use_dynamic_batch=True, train_max_tokens_per_gpu=100, rollout_max_tokens_per_gpu=300)
    assert (critic.train.max_tokens, critic.forward_max_tokens) == (100, 300)
    off = of("actor", train_max_tokens_per_gpu=100)
    assert (off.train.max_tokens, off.forward_max_tokens) == (0, 0)  # budgets only with --use_dynamic_batch


def test_device_auto_without_gpu_device_files_is_cpu_without_torch(monkeypatch):
    """--device auto on a Linux machine with no GPU device file: cpu, decided without importing torch (the driver
    would load it on its main thread before Ray's start); with device files, torch decides as before."""
    import subprocess
    import sys

    from orlhf.config import resolve as finish
    from orlhf.config.flags import parse_config

    cfg = parse_config({"device": "auto"})
    if finish.no_gpu_device_files():
        import torch

        assert not torch.cuda.is_available()  # what the shortcut stands for, on this machine
        code = (
            "import sys; from orlhf.config.resolve import resolve_device; from orlhf.config.flags import parse_config; "
            "print(resolve_device(parse_config({'device': 'auto'})).device, 'torch' in sys.modules)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["cpu", "False"]
    monkeypatch.setattr(finish, "no_gpu_device_files", lambda: False)
    monkeypatch.setattr(finish, "_torch_device", lambda: "cuda")
    assert finish.resolve_device(cfg).device == "cuda"
    monkeypatch.undo()
    monkeypatch.setattr(finish.sys, "platform", "win32")
    assert finish.no_gpu_device_files() is False  # elsewhere torch is asked
