"""Which checkpoint layouts load into which groups (storage/ds_layout.py), and the one line for each refusal.
tests/workers/test_universal_ckpt_mp.py converts and loads real checkpoints; this is the rule table."""

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
    assert "written by 2 actor ranks, this run has 1: pass --use_ds_universal_ckpt" in msg
    assert "or resume on 2 actor ranks" in msg
    assert "pass --use_ds_universal_ckpt" in refusal(1, 0, 4, 0, False)  # even where nothing would need converting


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
