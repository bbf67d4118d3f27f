"""Which checkpoint layouts load into which groups (storage/ds_layout.py), and the one line for each refusal.
tests/workers/test_universal_ckpt_mp.py converts and loads real checkpoints; this is the rule table."""

import shutil

import pytest
import torch

from orlhf.storage.checkpoint_format import CheckpointError
from orlhf.storage.ds_layout import AS_SAVED, UNIVERSAL, Layout, load_plan, read_layout


def plan(saved_ranks, saved_stage, ranks, stage, universal, optimizer="adam"):
    layout = Layout(saved_ranks, "global_step3", saved_stage, optimizer)
    return load_plan("actor", layout, ranks, stage, universal, "/ck/step_000003/actor")


def refusal(*args, **kw) -> str:
    with pytest.raises(CheckpointError) as err:
        plan(*args, **kw)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("/ck/step_000003/actor: ")
    return msg


@pytest.mark.parametrize("universal", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_same_rank_count_loads_as_saved_flag_or_not(stage, universal):
    assert plan(2, stage, 2, stage, universal) == AS_SAVED
    assert plan(1, None, 1, stage, universal) == AS_SAVED  # a checkpoint that records no stage: as before


def test_another_rank_count_without_the_flag_names_it():
    msg = refusal(2, 3, 1, 3, False)
    assert "saved under ZeRO-3 on 2 ranks, this run trains the actor under ZeRO-3 on 1" in msg
    assert msg.endswith(": resume with --use_ds_universal_ckpt, or on 2 actor ranks")
    assert "resume with --use_ds_universal_ckpt," in refusal(1, 0, 4, 0, False)  # even where nothing is converted


@pytest.mark.parametrize("saved, now", [(3, 2), (2, 3), (0, 2), (3, 0)])
def test_without_the_flag_the_refusal_names_the_stage_the_conversion_needs_too(saved, now):
    """One start refused, not two: the flag and the --zero_stage it needs, in one line (ZeRO-3 on several ranks
    resumed on one rank, whose default is no ZeRO, is the common case)."""
    assert f"resume with --use_ds_universal_ckpt --zero_stage {saved}, or on 2 actor ranks" in refusal(
        2, saved, 1, now, False
    )


@pytest.mark.parametrize("saved, now", [(3, 3), (2, 2), (1, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("ranks", [(2, 1), (1, 2), (4, 2)])
def test_another_rank_count_with_the_flag_converts_within_a_stage_family(saved, now, ranks):
    assert plan(ranks[0], saved, ranks[1], now, True) == UNIVERSAL


def test_zero0_needs_no_conversion():
    assert plan(2, 0, 1, 0, True) == AS_SAVED  # whole weights and optimizer on every rank


@pytest.mark.parametrize(
    "saved, now, why",
    [
        (3, 2, "only into the stage family that wrote it (ZeRO-1/2, or ZeRO-3): resume with --zero_stage 3"),
        (2, 3, "only into the stage family that wrote it (ZeRO-1/2, or ZeRO-3): resume with --zero_stage 2"),
        (0, 2, "ZeRO-0 neither converts nor loads a universal checkpoint: resume with --zero_stage 0"),
        (3, 0, "ZeRO-0 neither converts nor loads a universal checkpoint: resume with --zero_stage 3"),
    ],
)
def test_another_stage_family_is_refused_with_the_stage_to_pass(saved, now, why):
    msg = refusal(2, saved, 1, now, True)
    assert f"saved under ZeRO-{saved} on 2 ranks, this run trains the actor under ZeRO-{now} on 1" in msg
    assert why in msg


def test_other_refusals():
    # one rank's default stage is 2, several ranks' 3: the same rank count with a changed stage is not converted
    assert "saved under ZeRO-3, this run trains the actor under ZeRO-2" in refusal(2, 3, 2, 2, True)
    assert "resume with --zero_stage 3" in refusal(2, 3, 2, 2, False)
    assert "Muon" in refusal(2, 3, 1, 3, True, optimizer="muon")
    assert "resumes on 2 actor ranks only" in refusal(2, 3, 1, 3, False, optimizer="muon")  # the flag cannot help
    assert "does not record its ZeRO stage" in refusal(2, None, 1, 3, True)
    assert "written by 0 actor ranks, this group has 2: no actor checkpoint here" in refusal(0, None, 2, 3, True)


def test_read_layout_takes_ranks_tag_stage_and_optimizer_from_the_files(tmp_path):
    assert read_layout(tmp_path / "missing") == Layout(0)
    role = tmp_path / "actor"
    (role / "global_step3").mkdir(parents=True)
    for r in range(2):
        (role / f"rng_rank{r}.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no DeepSpeed checkpoint here"):
        read_layout(role)
    (role / "latest").write_text("global_step3\n")
    with pytest.raises(CheckpointError, match="no DeepSpeed model-state file"):
        read_layout(role)
    config = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "Muon", "params": {}}}
    torch.save(
        {"ds_config": config, "module": torch.zeros(3)},
        role / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
    )
    assert read_layout(role) == Layout(2, "global_step3", 3, "muon")


def test_the_flag_reaches_the_trained_roles_slices():
    from orlhf.config.flags import parse_config
    from orlhf.config.resolve import resolve_device
    from orlhf.config.worker_config import worker_config

    for on in (False, True):
        flags = {"pretrain": "model", "advantage_estimator": "gae", "use_ds_universal_ckpt": on}
        cfg = resolve_device(parse_config(flags, set(flags)), "cpu")
        assert [worker_config(cfg, role).train.universal_ckpt for role in ("actor", "critic")] == [on, on]


def saved_role(folder, ranks: int, stage: int) -> None:
    """A role's DeepSpeed checkpoint as read_layout sees it: the ranks' RNG files, `latest`, one model-state file."""
    (folder / "global_step3").mkdir(parents=True)
    (folder / "latest").write_text("global_step3\n")
    for r in range(ranks):
        (folder / f"rng_rank{r}.json").write_text("{}")
    torch.save({"ds_config": {"zero_optimization": {"stage": stage}}}, folder / "global_step3" / "mp_model_states.pt")


def test_a_resume_names_every_role_and_what_loads_them_all_at_once(tmp_path):
    """Actor and critic saved on 2 ranks each, resumed on 1 each (no ZeRO by default): one start refused, naming
    each role's fix and the one that serves both (one --zero_stage is every role's), or that none does."""
    from orlhf.config.flags import parse_config
    from orlhf.config.resolve import resolve_device
    from orlhf.storage.ds_layout import check_resume

    def check(**flags):
        flags = {"pretrain": "model", "advantage_estimator": "gae", **flags}
        return check_resume(tmp_path, resolve_device(parse_config(flags, set(flags)), "cpu"))

    saved_role(tmp_path / "actor", 2, 3)
    saved_role(tmp_path / "critic", 2, 3)
    with pytest.raises(CheckpointError) as err:
        check()
    actor, critic, both = str(err.value).splitlines()
    assert actor.startswith(f"{tmp_path / 'actor'}: ") and critic.startswith(f"{tmp_path / 'critic'}: ")
    assert both == "every role loads with: --use_ds_universal_ckpt --zero_stage 3"
    assert check(use_ds_universal_ckpt=True, zero_stage=3) == {"actor": UNIVERSAL, "critic": UNIVERSAL}

    shutil.rmtree(tmp_path / "critic")
    saved_role(tmp_path / "critic", 2, 2)  # the critic's family is ZeRO-1/2, the actor's ZeRO-3
    with pytest.raises(CheckpointError) as err:
        check(use_ds_universal_ckpt=True)
    assert str(err.value).splitlines()[-1] == (
        "no one --zero_stage (it is the same for every role) loads every role on this run's rank counts: resume on "
        "the rank counts that saved them (actor 2, critic 2)"
    )
