"""orlhf/storage/checkpoint.py and checkpoint_state.py without DeepSpeed: atomic commit, what latest() accepts,
rotation, the config check, and the driver's state (with RNG) round trip through JSON + safetensors."""

import dataclasses
import json
import logging
import random

import numpy as np
import pytest
import torch

from orlhf.config.fingerprint import config_fingerprint
from orlhf.config.train_config import TrainConfig
from orlhf.storage.checkpoint import CheckpointManager, read_meta
from orlhf.storage.checkpoint_format import CheckpointError, check_compatible
from orlhf.storage.checkpoint_state import (
    load_controller_state,
    rng_state,
    save_controller_state,
    save_state,
    set_rng_state,
)


def _meta(cfg: TrainConfig | None = None) -> dict:
    return {"fingerprint": config_fingerprint(cfg or TrainConfig())}


def _save(mgr: CheckpointManager, step: int, roles: dict | None = None):
    tmp = mgr.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard.bin").write_bytes(b"x" * 10)
    for r in range((roles or {}).get("actor", 0)):
        (tmp / "actor" / f"rng_rank{r}.json").write_text("{}")
    return mgr.commit(tmp, step, {**_meta(), **({"roles": roles} if roles else {})})


def test_commit_renames_into_place_with_meta_written(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", max_ckpt_num=3)
    tmp = mgr.begin(10)
    assert tmp.parent == mgr.root and tmp.name.startswith(".tmp-step_000010-") and mgr.latest() is None
    final = _save(mgr, 10, roles={"actor": 2})
    assert final == mgr.root / "step_000010" and mgr.latest() == final
    meta = read_meta(final)
    assert meta["step"] == 10 and meta["format"] == 1 and meta["roles"] == {"actor": 2} and meta["orlhf_version"]
    assert (final / "actor" / "shard.bin").read_bytes() == b"x" * 10
    assert sorted(p.name for p in mgr.root.iterdir()) == [tmp.name, "step_000010"]  # only the unused begin() left


def test_latest_skips_unfinished_and_incomplete_folders(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=5)
    done = _save(mgr, 10)
    crashed = mgr.begin(20)  # a save that died before commit: holds files, never meta.json nor the final name
    (crashed / "actor").mkdir()
    (crashed / "meta.json").write_text(json.dumps({"step": 20}))  # even with a meta.json inside
    (tmp_path / "step_000030").mkdir()  # no meta.json: e.g. copied by hand, half-way
    (tmp_path / "step_000040").mkdir()
    (tmp_path / "step_000040" / "meta.json").write_text("{not json")
    (tmp_path / "step_000050").mkdir()
    (tmp_path / "step_000050" / "meta.json").write_text(json.dumps({"step": 7}))  # describes another step
    with caplog.at_level(logging.INFO, logger="orlhf.storage.checkpoint"):
        assert mgr.latest() == done
    log = caplog.text
    assert crashed.name in log and "unfinished" in log
    assert "step_000030: no meta.json" in log and "step_000040: unreadable" in log and "step_000050" in log
    assert mgr.cleanup_stale_tmp() == [crashed] and not crashed.exists()
    assert (tmp_path / "step_000030").exists()  # incomplete step_ folders are reported, never deleted


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_truncated_or_missing_file_in_the_newest_falls_back_to_the_previous_naming_it(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=5)
    older = _save(mgr, 2, roles={"actor": 1})
    newest = _save(mgr, 4, roles={"actor": 1})
    assert read_meta(newest)["files"] == {"actor/shard.bin": 10, "actor/rng_rank0.json": 2}  # not meta/owner
    shard = newest / "actor" / "shard.bin"
    if damage == "truncate":  # a full disk, an interrupted copy
        shard.write_bytes(b"x" * 4)
    else:
        shard.unlink()
    with caplog.at_level(logging.WARNING, logger="orlhf.storage.checkpoint"):
        assert mgr.latest() == older
    problem = "has 4 bytes, 10 when saved (truncated" if damage == "truncate" else "is missing (10 bytes when saved)"
    assert f"ignoring {newest}: actor/shard.bin {problem}" in caplog.text
    assert newest.exists()  # reported, never deleted
    _save(mgr, 4, roles={"actor": 1})  # the resumed run saves that step again: it replaces the broken one
    assert mgr.latest() == newest and (newest / "actor" / "shard.bin").stat().st_size == 10


def test_checkpoints_without_recorded_sizes_stay_loadable(tmp_path):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=5)
    old = _save(mgr, 3)
    meta = read_meta(old)
    del meta["files"]  # as an orlhf before file sizes wrote it
    (old / "meta.json").write_text(json.dumps(meta))
    (old / "actor" / "shard.bin").write_bytes(b"x")
    assert mgr.latest() == old


def test_rotation_keeps_the_newest_n_and_touches_nothing_else(tmp_path):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=2)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_000000").mkdir()  # not a complete checkpoint: not the manager's to delete
    (tmp_path / "global_step5").mkdir()
    for step in (1, 2, 3, 4):
        _save(mgr, step)
    assert [p.name for p in mgr.complete()] == ["step_000004", "step_000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step5",
        "notes.txt",
        "step_000000",
        "step_000003",
        "step_000004",
    ]  # no .trash-* left
    keep_all = CheckpointManager(tmp_path / "all", max_ckpt_num=0)
    for step in (1, 2, 3):
        _save(keep_all, step)
    assert len(keep_all.complete()) == 3


def test_a_new_run_refuses_a_folder_with_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=3)
    mgr.check_new_run()  # empty (or missing) folder: fine
    mgr.begin(1)  # a leftover temp folder is no checkpoint
    mgr.check_new_run()
    _save(mgr, 8)
    with pytest.raises(
        CheckpointError, match="holds 1 checkpoint.*step_000008.*--load_checkpoint.*another --ckpt_path"
    ):
        mgr.check_new_run()


def test_commit_of_an_existing_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=3)
    _save(mgr, 5)
    tmp = mgr.begin(5)
    (tmp / "new").write_text("2")
    final = mgr.commit(tmp, 5, _meta())
    assert (final / "new").read_text() == "2" and not (final / "actor").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]


def test_commit_refuses_when_a_rank_left_no_files(tmp_path):
    # Rank 1 wrote to a disk the driver does not see (no shared filesystem): never a "complete" checkpoint.
    mgr = CheckpointManager(tmp_path, max_ckpt_num=3)
    tmp = mgr.begin(3)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "rng_rank0.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"ranks \[1\] of the actor group .*shared filesystem"):
        mgr.commit(tmp, 3, {**_meta(), "roles": {"actor": 2}})
    assert mgr.latest() is None and tmp.exists()
    with pytest.raises(ValueError, match="not a folder from CheckpointManager.begin"):
        mgr.commit(tmp_path / "elsewhere", 3, _meta())


def test_fingerprint_mismatch_lists_every_field_with_both_values(tmp_path):
    base = TrainConfig()
    other = dataclasses.replace(
        base,
        deepspeed=dataclasses.replace(base.deepspeed, zero_stage=2),
        placement=dataclasses.replace(base.placement, actor_num_gpus_per_node=4),
        ppo=dataclasses.replace(
            base.ppo,
            advantage_estimator="group_norm",
            n_samples_per_prompt=4,
            actor_learning_rate=1.0,
            micro_train_batch_size=2,
        ),  # micro batches are free
        logging=dataclasses.replace(base.logging, save_steps=7, max_ckpt_num=9),
    )  # so is everything here
    meta = {"format": 1, "fingerprint": config_fingerprint(base)}
    with pytest.raises(CheckpointError) as err:
        check_compatible(meta, config_fingerprint(other), path="/ck/step_000010")
    msg = str(err.value)
    assert "/ck/step_000010" in msg and "another --ckpt_path" in msg and "checkpoint's values" in msg
    # --zero_stage and the trained roles' rank counts are not listed: the checkpoint's own DeepSpeed layout is checked
    # when it loads (tests/unit/test_ds_layout.py)
    expected = [
        "--advantage_estimator: checkpoint 'gae', this run 'group_norm'",
        "--n_samples_per_prompt: checkpoint 1, this run 4",
        "--actor_learning_rate: checkpoint 1e-06, this run 1.0",
    ]
    for line in expected:
        assert f"  - {line}" in msg
    assert msg.count("\n  - ") == len(expected)  # nothing else (the critic model path is None on both sides)
    check_compatible(meta, config_fingerprint(dataclasses.replace(base, logging=other.logging)))  # no raise
    with pytest.raises(CheckpointError, match="format 99"):
        check_compatible({**meta, "format": 99}, config_fingerprint(base))
    with pytest.raises(CheckpointError, match=r"--seed: checkpoint \(not recorded\), this run 42"):
        check_compatible(
            {"format": 1, "fingerprint": {k: v for k, v in meta["fingerprint"].items() if k != "--seed"}},
            config_fingerprint(base),
        )


def test_flags_argued_free_later_are_ignored_in_older_fingerprints():
    # An orlhf that fingerprinted the rank counts and --zero_stage wrote these; they must still resume.
    now = config_fingerprint(TrainConfig())
    assert "--actor_num_gpus_per_node" not in now and "--zero_stage" not in now
    old = {**now, "--actor_num_gpus_per_node": 2, "--critic_num_nodes": 1, "--zero_stage": None}
    check_compatible({"format": 1, "fingerprint": old}, now)  # no raise
    with_flag = dataclasses.replace(
        TrainConfig(), logging=dataclasses.replace(TrainConfig().logging, use_ds_universal_ckpt=True)
    )
    check_compatible({"format": 1, "fingerprint": old}, config_fingerprint(with_flag))  # how it is read: free too


# Flags that change the trajectory, so the fingerprint must hold them; each refuses a resume when changed.
TRAJECTORY = {
    "remote_rm_url": "http://h:1/r",
    "input_template": "Q: {}",
    "apply_chat_template": True,
    "input_key": "q",
    "label_key": "a",
    "prompt_max_len": 7,
    "prompt_overflow": "truncate",
    "generate_max_len": 9,
    "temperature": 0.5,
    "gamma": 0.9,
    "lambd": 0.9,
    "kl_estimator": "k3",
    "use_kl_loss": True,
    "actor_learning_rate": 0.5,
    "critic_learning_rate": 0.5,
    "num_episodes": 9,
    "lr_warmup_ratio": 0.5,
    "max_epochs": 3,
}


@pytest.mark.parametrize("flag,value", sorted(TRAJECTORY.items()))
def test_every_trajectory_flag_is_fingerprinted(flag, value):
    from orlhf.config.flags import flag_fields

    base = TrainConfig()
    meta = {"format": 1, "fingerprint": json.loads(json.dumps(config_fingerprint(base)))}
    attr, name = next((a, f.name) for a, fl, f, _ in flag_fields() if fl == flag)
    changed = dataclasses.replace(base, **{attr: dataclasses.replace(getattr(base, attr), **{name: value})})
    with pytest.raises(CheckpointError, match=f"  - --{flag}: checkpoint "):
        check_compatible(meta, config_fingerprint(changed))
    check_compatible(meta, config_fingerprint(TrainConfig()))  # read back from JSON, it still matches


def test_every_flag_is_fingerprinted_or_argued_free():
    from orlhf.config.fingerprint import FREE_ON_RESUME
    from orlhf.config.flags import flag_fields

    flags = {flag for _, flag, _, _ in flag_fields()}
    assert set(FREE_ON_RESUME) <= flags, set(FREE_ON_RESUME) - flags  # no stale names
    fp = config_fingerprint(TrainConfig())
    assert {f"--{f}" for f in flags - set(FREE_ON_RESUME)} <= set(fp)


def test_fingerprint_paths_are_absolute(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain="model"))
    fp = config_fingerprint(cfg)
    assert fp["--pretrain"] == str(model)
    assert fp["critic model (--critic_pretrain, else --reward_pretrain, else --pretrain)"] == str(model)


def test_controller_state_round_trip_restores_values_and_rng(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.rand(5), random.random(), np.random.rand()  # move off the seeded states
    np.random.randn()  # numpy now caches a gaussian: has_gauss / cached_gaussian must come back too
    state = {
        "step_index": 12,
        "weight_version": 12,
        "episode": 1,
        "loader": {"episode": 1, "batch_in_episode": 2, "seed": 42, "batch_size": 64, "num_prompts": 300},
        "kl_ctl": {"kind": "adaptive", "value": 0.1 + 0.2},
        "reward_norm": None,
        "clip_range": (-10.0, 10.0),
        "nested": [{"t": torch.arange(3, dtype=torch.int64)}],
        "rng": rng_state(),
    }
    save_controller_state(tmp_path, state)
    expected = (random.random(), np.random.rand(), np.random.randn(), torch.rand(4))
    random.random(), np.random.rand(5), torch.rand(9)  # the run goes on; RNGs move
    loaded = load_controller_state(tmp_path)
    set_rng_state(loaded["rng"])
    got = (random.random(), np.random.rand(), np.random.randn(), torch.rand(4))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
    assert {k: v for k, v in loaded.items() if k not in ("rng", "nested")} == {
        k: v for k, v in state.items() if k not in ("rng", "nested")
    }  # 0.1 + 0.2 exactly, the tuple a tuple
    assert torch.equal(loaded["nested"][0]["t"], state["nested"][0]["t"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["controller.json", "controller.safetensors"]  # no pickle


def test_save_state_refuses_what_it_cannot_store_safely(tmp_path):
    with pytest.raises(TypeError, match="cannot store a ndarray"):
        save_state(tmp_path, "x", {"a": np.zeros(2)})
    with pytest.raises(TypeError, match="keys must be strings"):
        save_state(tmp_path, "x", {1: 2})
    with pytest.raises(CheckpointError, match="cannot read controller.json"):
        load_controller_state(tmp_path)


def test_an_edited_reward_file_refuses_the_resume_naming_it(tmp_path, monkeypatch):
    """The reward_func file's contents are part of the fingerprint (not only its path): the resume lookup
    (launch.run_inputs.find_checkpoint) takes the checkpoint while the file is unchanged, and refuses it once edited."""
    import orlhf.storage.ds_layout
    from orlhf.config.flags import build_config
    from orlhf.launch.run_inputs import find_checkpoint

    # this checkpoint holds no DeepSpeed state: only the flags are compared (ds_layout's checks: test_ds_layout.py)
    monkeypatch.setattr(orlhf.storage.ds_layout, "check_resume", lambda path, cfg: {})

    reward = tmp_path / "my_reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    flags = {"save_path": str(tmp_path / "run"), "remote_rm_url": str(reward), "load_checkpoint": True}
    cfg = build_config(flags, set(flags))
    mgr = CheckpointManager(cfg.logging.checkpoint_dir, 3, run_id="r")
    tmp = mgr.begin(4)
    saved = mgr.commit(tmp, 4, {"fingerprint": json.loads(json.dumps(config_fingerprint(cfg)))})
    assert find_checkpoint(cfg, mgr) == saved  # unchanged run: resumes
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    with pytest.raises(CheckpointError) as err:
        find_checkpoint(cfg, mgr)
    (line,) = [x for x in str(err.value).splitlines() if x.startswith("  - ")]  # the only difference
    assert line.startswith("  - --remote_rm_url file contents: checkpoint 'sha256 ") and f"of {reward}'" in line
    assert "this run 'sha256 " in line


def test_load_checkpoint_on_a_first_run_starts_fresh_in_one_line(tmp_path, caplog):
    """OpenRLHF's meaning of --load_checkpoint: its scripts always pass it, so a first run (nothing saved yet) starts
    fresh; the run says where it looked. A checkpoint there is still checked against the flags."""
    import logging

    from orlhf.config.flags import build_config
    from orlhf.launch.run_inputs import find_checkpoint

    flags = {"save_path": str(tmp_path / "run"), "load_checkpoint": True, "save_steps": 2}
    cfg = build_config(flags, set(flags))
    mgr = CheckpointManager(cfg.logging.checkpoint_dir, 3, run_id="r")
    with caplog.at_level(logging.INFO, logger="orlhf"):
        assert find_checkpoint(cfg, mgr) is None
    assert f"--load_checkpoint: no checkpoint in {mgr.root}: starting fresh" in caplog.text
    other = build_config({**flags, "seed": 7}, set(flags) | {"seed"})
    tmp = mgr.begin(2)
    mgr.commit(tmp, 2, {"fingerprint": json.loads(json.dumps(config_fingerprint(other)))})
    with pytest.raises(CheckpointError, match="--seed: checkpoint 7, this run 42"):
        find_checkpoint(cfg, mgr)  # written under other flags: refused, as before


# ---- --max_ckpt_mem: a disk budget, as OpenRLHF applies it ---------------------------------------------------

MIB = 1024**2


def _save_mib(mgr: CheckpointManager, step: int, mib: int):
    tmp = mgr.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard.bin").write_bytes(b"x" * (mib * MIB))
    return mgr.commit(tmp, step, _meta())


def _openrlhf_keeps(sizes_mib: list[int], max_num: int, max_mem_mib: float, best_mib: int = 0) -> list[int]:
    """OpenRLHF v0.10.1's DeepspeedStrategy.save_ckpt rotation, replayed on sizes: before each save it deletes the
    oldest regular checkpoint while there are max_num or more, or while everything on disk (a best checkpoint
    included, never deleted) exceeds max_mem; then saves. Returns the steps left after the last save."""
    on_disk: list[tuple[int, int]] = []  # (step, MiB), oldest first
    for step, size in enumerate(sizes_mib, 1):
        while on_disk and (len(on_disk) - max_num + 1 > 0 or sum(s for _, s in on_disk) + best_mib > max_mem_mib):
            on_disk.pop(0)
        on_disk.append((step, size))
    return [step for step, _ in on_disk]


@pytest.mark.parametrize(
    "sizes, max_num, budget, best",
    [
        ([1] * 6, 10, 2.5, 0),  # the budget alone: the newest and two more
        ([3, 1, 1, 2, 1, 1, 4, 1], 10, 2.5, 0),  # sizes that vary, one over the budget by itself
        ([1] * 6, 2, 100.5, 0),  # --max_ckpt_num alone
        ([1, 2, 1, 1, 1], 3, 1.5, 0),  # both: whichever keeps fewer
        ([1] * 5, 10, 3.5, 2),  # a best checkpoint counts against the budget, and is kept
    ],
)
def test_max_ckpt_mem_keeps_what_openrlhf_keeps(tmp_path, caplog, sizes, max_num, budget, best):
    mgr = CheckpointManager(tmp_path, max_ckpt_num=max_num, max_ckpt_mem=budget / 1024)  # GiB
    if best:
        _save_mib(mgr.best(), 99, best)
    with caplog.at_level(logging.INFO, logger="orlhf.storage.checkpoint"):
        for step, size in enumerate(sizes, 1):
            _save_mib(mgr, step, size)
            assert mgr.latest().name == f"step_{step:06d}"  # the newest is never deleted
            kept = sorted(int(p.name.removeprefix("step_")) for p in mgr.complete())
            assert kept == _openrlhf_keeps(sizes[:step], max_num, budget, best), f"after step {step}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trash")]
    if budget < 100:
        assert "rotated out (--max_ckpt_mem" in caplog.text
    if best:
        assert [p.name for p in mgr.best().complete()] == ["step_000099"]


def test_no_budget_keeps_what_max_ckpt_num_keeps(tmp_path):
    for budget in (None, float("inf")):
        mgr = CheckpointManager(tmp_path / str(budget), max_ckpt_num=3, max_ckpt_mem=budget)
        for step in range(1, 6):
            _save_mib(mgr, step, 1)
        assert [p.name for p in mgr.complete()] == ["step_000005", "step_000004", "step_000003"]


def test_a_refused_resume_names_where_this_runs_values_came_from(tmp_path, monkeypatch, no_training):
    """Every checkpoint keeps the resolved configuration it was written under (run_config.json); a resume refused
    for other flags (check_compatible decides) also says where each of this run's values came from."""
    import orlhf.storage.ds_layout
    from orlhf.cli import main
    from orlhf.config.provenance import dump_resolved, read_resolved
    from orlhf.launch.run import write_resolved_config
    from orlhf.launch.run_inputs import find_checkpoint
    from orlhf.storage.run_folder import RunFolder, checkpoint_config

    monkeypatch.setattr(orlhf.storage.ds_layout, "check_resume", lambda path, cfg: {})
    run = tmp_path / "run"
    for argv in (["--seed", "7"], ["--seed", "8", "--actor.adam.lr", "1e-4"]):
        with pytest.raises(SystemExit):  # the CLI exits with the (stand-in) run's code
            main(["train-ppo", "--save_path", str(run), "--load_checkpoint", *argv])
    saved_cfg, cfg = no_training
    write_resolved_config(saved_cfg)
    assert read_resolved(RunFolder.at(run).config)["seed"] == 7  # the run folder's copy, read back
    mgr = CheckpointManager(cfg.logging.checkpoint_dir, 3, run_id="r")
    tmp = mgr.begin(2)
    checkpoint_config(tmp).write_text(dump_resolved(saved_cfg))  # as save_run writes it
    mgr.commit(tmp, 2, {"fingerprint": json.loads(json.dumps(config_fingerprint(saved_cfg)))})
    with pytest.raises(CheckpointError) as err:
        find_checkpoint(cfg, mgr)
    text = str(err.value)
    assert "--seed: checkpoint 7, this run 8" in text  # the deciding comparison, as before
    assert "  - --seed: 7 when saved, 8 now (flag)" in text
    assert "  - --actor_learning_rate: 0.0005 when saved, 0.0001 now (openrlhf --actor.adam.lr)" in text
