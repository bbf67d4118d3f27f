"""Every flag name of OpenRLHF v0.10.1, v0.11.0 and 0.11.2's train_ppo_ray is known to orlhf: an orlhf flag, another
spelling of one, a documented no-op, or refused by name with the reason. The lists are data
(tests/data/openrlhf_flags/, extracted from the sources by scripts/openrlhf_flags.py; each file's first line is the
command that made it)."""

from pathlib import Path

import pytest

from orlhf.config import flags as F
from orlhf.config.openrlhf import ALIASES, DOTTED_ONLY, NO_EFFECT, OPENRLHF_V0101_FLAGS, UNSUPPORTED, NoEffect
from orlhf.config.openrlhf_dotted import DOTTED

LISTS = Path(__file__).parent.parent / "data" / "openrlhf_flags"
VERSIONS = {"v0.10.1": 144, "v0.11.0": 164, "v0.11.2": 167}


def names(version: str) -> list[str]:
    lines = (LISTS / f"{version}.txt").read_text().splitlines()
    assert lines[0].startswith("# OpenRLHF") and "scripts/openrlhf_flags.py" in lines[0]
    return [line for line in lines[1:] if line]


def how_known(name: str) -> str:
    """What orlhf does with one OpenRLHF flag name ("" when it does not know it)."""
    ours = {n for _, n, _, _ in F.flag_fields()}
    if name in DOTTED_ONLY:
        return "no-op" if isinstance(DOTTED_ONLY[name], NoEffect) else "refused"
    flat = DOTTED.get(name, name)
    if "." in flat:
        return ""
    if flat in ours:
        return "flag"
    if flat in ALIASES:
        return "alias"
    if flat in NO_EFFECT:
        return "no-op"
    if flat in UNSUPPORTED:
        return "refused"
    return ""


@pytest.mark.parametrize("version", list(VERSIONS))
def test_every_flag_name_of_each_release_is_known(version):
    listed = names(version)
    assert len(listed) == len(set(listed)) == VERSIONS[version]
    unknown = [n for n in listed if not how_known(n)]
    assert not unknown, f"OpenRLHF {version} flags orlhf does not know: {unknown}"


def test_the_v0101_table_is_the_extracted_list():
    assert list(OPENRLHF_V0101_FLAGS) == names("v0.10.1")


def test_every_refusal_and_no_op_says_why():
    for spec in list(UNSUPPORTED.values()) + [s for s in DOTTED_ONLY.values() if not isinstance(s, NoEffect)]:
        assert len(spec.what) > 10
    for spec in list(NO_EFFECT.values()) + [s for s in DOTTED_ONLY.values() if isinstance(s, NoEffect)]:
        assert len(spec.why) > 20


def test_muon_flags_reach_their_role_and_fixed_newton_schulz_settings_are_refused(capsys, no_training):
    from orlhf.cli import main
    from orlhf.config.resolve import resolve_demo
    from orlhf.config.worker_config import worker_config

    argv = ["train-ppo", "--device", "cpu", "--advantage_estimator", "gae", "--critic.optim=adam"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--actor.optim", "muon", "--actor.muon.lr", "0.03", "--actor.muon.nesterov"])
    assert e.value.code == 0, capsys.readouterr().err
    cfg = resolve_demo(no_training[0])
    actor, critic = worker_config(cfg, "actor").train, worker_config(cfg, "critic").train
    assert (actor.optim, actor.muon_lr, critic.optim) == ("muon", 0.03, "adam")
    with pytest.raises(SystemExit) as e:
        main(["train-ppo", "--device", "cpu", "--critic.muon.ns_steps", "6"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--critic.muon.ns_steps 6: orlhf does not support it yet (other Muon" in err
    with pytest.raises(SystemExit) as e:
        main(["train-ppo", "--device", "cpu", "--actor.optim", "muon", "--adam_offload"])
    assert e.value.code == 2 and "--actor_optim muon with --adam_offload" in capsys.readouterr().err
