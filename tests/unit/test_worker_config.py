"""Each role's config holds only what that role uses, and the config is finished (device, validation, demo) in
one place: config/resolve.py."""

import dataclasses

import pytest

from orlhf.config.flags import parse_config
from orlhf.config.roles import ROLES
from orlhf.config.train_config import ConfigError
from orlhf.config.worker_config import ActorConfig, CriticConfig, RefConfig, RewardConfig, role_config, worker_config
from orlhf.config.worker_slices import TrainSlice


def field_names(obj) -> set[str]:
    """Every field name in a config and its nested slices."""
    names = set()
    for f in dataclasses.fields(obj):
        names.add(f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            names |= field_names(value)
    return names


@pytest.fixture
def cfg():
    from orlhf.config.resolve import resolve_device

    flags = {"pretrain": "model", "reward_pretrain": "rm", "use_kl_loss": True}
    return resolve_device(parse_config(flags, set(flags)), "cpu")  # every role (gae: a critic; a KL: a reference)


def test_each_role_gets_only_its_slices(cfg):
    configs = {role: worker_config(cfg, role, 7) for role in ROLES}
    assert [type(c) for c in configs.values()] == [ActorConfig, RefConfig, CriticConfig, RewardConfig]
    ref, critic, reward, actor = configs["ref"], configs["critic"], configs["reward"], configs["actor"]
    optimizer = {f.name for f in dataclasses.fields(TrainSlice)}  # learning_rate, adam_betas, max_norm, ...
    for frozen in (ref, reward):
        assert not field_names(frozen) & (optimizer | {"train", "eps_clip", "value_clip", "loss_agg_mode"})
    assert not hasattr(ref, "learning_rate") and not hasattr(ref, "train")
    assert "eps_clip" not in field_names(critic) and not hasattr(critic, "eps_clip")
    assert "value_clip" not in field_names(actor) and "value_head_prefix" not in field_names(actor)
    assert "temperature" not in field_names(critic) | field_names(reward)  # value heads do not sample
    # A training slice exactly for the roles that train (config/roles.py), with the right learning rate.
    for role, c in configs.items():
        assert hasattr(c, "train") == ROLES[role].trains == c.trainable, role
    assert (actor.train.learning_rate, critic.train.learning_rate) == (
        cfg.ppo.actor_learning_rate,
        cfg.ppo.critic_learning_rate,
    )
    assert actor.train.total_optimizer_steps == critic.train.total_optimizer_steps == 7
    assert critic.loss.value_clip == cfg.ppo.value_clip and actor.loss.eps_clip == cfg.ppo.eps_clip
    assert (reward.model_path, critic.head.value_head_prefix) == ("rm", cfg.data.value_head_prefix)
    assert all(c.device == "cpu" and c.role == role for role, c in configs.items())


def test_role_config_refuses_a_field_the_role_does_not_have():
    with pytest.raises(TypeError, match="critic config has no field 'eps_clip'"):
        role_config("critic", model_path="m", device="cpu", eps_clip=0.2)
    with pytest.raises(TypeError, match="ref config has no field 'learning_rate'"):
        role_config("ref", model_path="m", device="cpu", learning_rate=1e-3)
    c = role_config("critic", model_path="m", device="cpu", learning_rate=1e-3, value_clip=0.5, normalize_reward=True)
    assert (c.train.learning_rate, c.loss.value_clip, c.head.normalize_reward) == (1e-3, 0.5, True)


def test_the_device_is_read_from_the_finished_config_only():
    from orlhf.launch.bringup import run_layout

    cfg = parse_config({"pretrain": "model"}, {"pretrain"})  # --device auto: not resolved
    for use in (run_layout, lambda c: worker_config(c, "actor")):
        with pytest.raises(ValueError, match="not resolved yet; finish the config first"):
            use(cfg)


def test_finish_validates_once_against_the_resolved_device(monkeypatch):
    import torch

    from orlhf.config import resolve as finish
    from orlhf.config import validation

    calls = []
    real = validation.validate
    monkeypatch.setattr(
        validation,
        "validate",
        lambda c, explicit=(), local_packages=True: calls.append(c.runtime.device) or real(c, explicit, local_packages),
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    done = finish.finish_config({"seed": 3}, {"seed"})  # --device auto, the demo
    assert calls == ["cpu"] and done.device == "cpu" and done.vllm.sync_backend == "gloo"
    assert not done.data.uses_demo and done.data.pretrain.endswith("model")  # the demo's paths are filled in
    # --device auto on a machine without a GPU: the cuda-only flag is named (the CLI exits 2 with it).
    bad = {"vllm_sync_backend": "nccl"}
    with pytest.raises(ConfigError, match="--vllm_sync_backend nccl needs CUDA GPUs"):
        finish.finish_config(bad, set(bad))
    assert parse_config(bad, set(bad)).runtime.device == "auto"  # parsing alone neither resolves nor validates


def test_cli_exits_2_naming_the_flag_when_the_resolved_device_refuses_it(capsys, monkeypatch, no_training):
    import torch

    from orlhf.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--flash_attn", "--bf16"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--flash_attn needs CUDA GPUs" in err and not no_training
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--device", "cpu"])
    assert exit_.value.code == 0
    finished = no_training[0]  # the run gets the finished config: device and demo resolved
    assert finished.device == "cpu" and not finished.data.uses_demo and finished.data.remote_rm_url


def _run_cfg(device: str, **flags):
    from orlhf.config.resolve import resolve_device

    flags = {"pretrain": "model", "reward_pretrain": "rm", "use_kl_loss": True, **flags}
    return resolve_device(parse_config(flags, set(flags)), device)


def test_zero_stage_default_is_3_except_for_one_rank_groups():
    one_rank = _run_cfg("cpu")  # every group has one rank: nothing to partition
    assert {r: worker_config(one_rank, r).zero_stage for r in ("actor", "critic", "ref", "reward")} == {
        "actor": 0,
        "critic": 0,
        "ref": 0,
        "reward": 0,
    }
    wide = _run_cfg("cpu", actor_num_gpus_per_node=2, ref_num_nodes=2)
    assert worker_config(wide, "actor").zero_stage == 3 and worker_config(wide, "ref").zero_stage == 3
    assert worker_config(wide, "critic").zero_stage == 0  # still one rank
    for stage in (0, 1, 2, 3):  # a stage the user gives is used everywhere, whatever the group size
        given = _run_cfg("cpu", zero_stage=stage, actor_num_gpus_per_node=2)
        assert {worker_config(given, r).zero_stage for r in ("actor", "critic", "ref", "reward")} == {stage}


def test_zero_stage_stays_3_where_a_flag_needs_zero3():
    sleep = _run_cfg("cuda", colocate_all_models=True, deepspeed_enable_sleep=True)  # offload_states is ZeRO-3's
    assert worker_config(sleep, "actor").zero_stage == 3 and worker_config(sleep, "ref").zero_stage == 0
    offload = _run_cfg("cuda", ref_reward_offload=True)  # parameter offload is ZeRO-3 only
    assert worker_config(offload, "ref").zero_stage == 3 and worker_config(offload, "actor").zero_stage == 0
    assert worker_config(_run_cfg("cpu", ref_reward_offload=True), "ref").zero_stage == 0  # no param offload on CPU


def test_a_one_rank_trained_group_keeps_zero2_in_bf16_and_where_it_needs_zeros_optimizer():
    def stages(device="cpu", **flags):
        cfg = _run_cfg(device, **flags)
        return worker_config(cfg, "actor").zero_stage, worker_config(cfg, "critic").zero_stage

    assert stages() == (0, 0)  # fp32: no ZeRO
    assert stages("cuda", bf16=True) == (2, 2)  # without ZeRO, bf16 would hold an fp32 gradient copy on top
    assert stages(adam_offload=True) == (2, 2)  # ZeRO-Offload
    assert stages(grad_accum_dtype="bf16") == (2, 2)  # ZeRO-0 accumulates in the model's dtype only
    assert stages(grad_accum_dtype="fp32") == (0, 0)  # the model's own
    assert stages(actor_optim="muon") == (2, 0)  # DeepSpeed's Muon is ZeRO's optimizer
