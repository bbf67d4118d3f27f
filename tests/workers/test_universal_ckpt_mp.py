"""--use_ds_universal_ckpt on real process groups (gloo, no Ray): a checkpoint saved by 2 ranks resumes on 1.

Two spawns. Each rank runs:

    saved (2 ranks):   actor (ZeRO-3) + critic (ZeRO-2) init -> 1 train step -> save_checkpoint(<ck>/step_000001/<role>)
                       -> the full fp32 weights and Adam moments -> 1 more train step on its half (the reference)
    resumed (1 rank):  actor (ZeRO-3) + critic (ZeRO-1: the same stage family) init with the flag ->
                       load_checkpoint (converts to <role>_universal first), torch.load spied on -> the same state
                       -> the same step on the whole batch

Expected: the resumed weights and Adam moments equal the saved ones (they are copied, not recomputed), the step
counters and LR schedule come back, and the next step equals the 2-rank one to float rounding (the same global
batch, averaged in another order; as test_workers_mp's world-size test). That last check also holds the
accumulation boundaries in place: 1 rank runs 4 micro-batches per step where each of 2 ranks ran 2.
"""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks
from test_checkpoint_mp import setup  # noqa: F401 - the tiny model and experience, a fixture
from test_workers_mp import B, _cfg

STAGES = {2: {"actor": 3, "critic": 2}, 1: {"actor": 3, "critic": 1}}  # world size -> each role's ZeRO stage


def _workers(lm: str, world: int) -> dict:
    from orlhf.workers import CriticWorker, PolicyWorker

    kinds = {"actor": PolicyWorker, "critic": CriticWorker}
    workers = {
        role: kinds[role](_cfg(role, lm, zero_stage=stage, lr_warmup_ratio=0.5, universal_ckpt=world == 1))
        for role, stage in STAGES[world].items()
    }
    for w in workers.values():
        w.init()
    return workers


def _optimizer_state(w) -> dict:
    """{name: (fp32 master, exp_avg, exp_avg_sq)}, whole, on every rank (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        n: tuple(
            t.detach().float().cpu().clone()
            for t in (
                safe_get_full_fp32_param(p),
                safe_get_full_optimizer_state(p, "exp_avg"),
                safe_get_full_optimizer_state(p, "exp_avg_sq"),
            )
        )
        for n, p in w.module.named_parameters()
    }


def _step(workers: dict, exp, share) -> dict:
    out = {}
    for role, w in workers.items():
        s = w.train_step(share)
        out[role] = {"lr": s.lr, "weights": w.state_dict_full(), "steps": w.engine.global_steps}
    return out


def _saved_main(rank: int, world: int, port: int, ctx: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from orlhf.storage.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    exp, workers = ctx["exp"], _workers(ctx["lm"], world)
    half = exp.split([B // 2] * 2)[rank]
    _step(workers, exp, half)
    mgr = CheckpointManager(ctx["root"] / "ck", max_ckpt_num=2)
    tmp = [mgr.begin(1) if rank == 0 else None]  # the driver's part, played by rank 0
    dist.broadcast_object_list(tmp, src=0)
    for role, w in workers.items():
        w.save_checkpoint(str(tmp[0] / role))
    if rank == 0:
        mgr.commit(tmp[0], 1, {"fingerprint": {}, "roles": {role: world for role in workers}})
    dist.barrier()
    out = {"state": {role: _optimizer_state(w) for role, w in workers.items()}, "next": _step(workers, exp, half)}
    torch.save(out, Path(out_dir) / f"saved_rank{rank}.pt")


def _resumed_main(rank: int, world: int, port: int, ctx: dict, out_dir: str) -> None:
    from orlhf.storage.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    workers = _workers(ctx["lm"], world)
    latest, calls, real_load = CheckpointManager(ctx["root"] / "ck", max_ckpt_num=2).latest(), [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    torch.load = spy
    try:
        for role, w in workers.items():
            w.load_checkpoint(str(latest / role))
    finally:
        torch.load = real_load
    out = {
        "state": {role: _optimizer_state(w) for role, w in workers.items()},
        "steps": {role: w.engine.global_steps for role, w in workers.items()},
        "load_weights_only": calls,
        "next": _step(workers, ctx["exp"], ctx["exp"]),
    }
    torch.save(out, Path(out_dir) / "resumed_rank0.pt")


@pytest.fixture(scope="module")
def runs(setup) -> dict:  # noqa: F811 - the imported fixture
    out_dir = setup["root"] / "universal_out"
    out_dir.mkdir()
    spawn_ranks(_saved_main, 2, setup, str(out_dir))
    spawn_ranks(_resumed_main, 1, setup, str(out_dir))
    load = lambda name: torch.load(out_dir / f"{name}.pt", weights_only=False)  # noqa: E731 - our own output
    return {
        "saved": load("saved_rank0"),
        "resumed": load("resumed_rank0"),
        "step": setup["root"] / "ck" / "step_000001",
    }


def test_weights_and_adam_moments_come_back_on_another_rank_count(runs):
    for role in STAGES[2]:
        saved, got = runs["saved"]["state"][role], runs["resumed"]["state"][role]
        assert saved.keys() == got.keys() and len(saved) > 0
        for name in saved:
            for what, a, b in zip(("fp32", "exp_avg", "exp_avg_sq"), saved[name], got[name]):
                assert torch.allclose(a, b, rtol=0, atol=1e-6), f"{role} {name} {what}"
        assert any(m.abs().sum() > 0 for _, m, _ in saved.values())  # the moments are a step's, not zeros


def test_the_next_step_equals_the_uninterrupted_two_rank_one(runs):
    for role in STAGES[2]:
        ref, got = runs["saved"]["next"][role], runs["resumed"]["next"][role]
        assert runs["resumed"]["steps"][role] == 1 and got["steps"] == ref["steps"] == 2
        assert got["lr"] == pytest.approx(ref["lr"], rel=1e-9)  # the LR schedule came back (warm-up: not the peak)
        worst = max((ref["weights"][k] - got["weights"][k]).abs().max().item() for k in ref["weights"])
        assert worst <= 1e-5, f"{role}: {worst}"


def test_the_conversion_is_kept_beside_the_checkpoint_and_reused(runs, monkeypatch):
    from orlhf.storage.checkpoint import CheckpointManager
    from orlhf.workers import universal_ckpt

    step = runs["step"]
    assert sorted(p.name for p in step.iterdir() if "universal" in p.name or p.name.startswith(".tmp")) == [
        "actor_universal",
        "critic_universal",
    ]  # no temporary folder left
    assert (step / "actor_universal" / "latest_universal").read_text() == "global_step1"
    assert CheckpointManager(step.parent, max_ckpt_num=2).latest() == step  # still a complete checkpoint
    monkeypatch.setattr(universal_ckpt, "_convert", lambda *a: pytest.fail("converted again"))
    assert universal_ckpt.universal_folder(step / "actor", "global_step1", 0, 1) == step / "actor_universal"


def test_every_load_is_weights_only(runs):
    calls = runs["resumed"]["load_weights_only"]
    assert len(calls) > 10 and all(w is True for w in calls), calls  # the conversion's reads included


def test_the_run_is_checked_before_it_starts(runs):
    """storage/ds_layout.check_resume on the real folder, as the driver calls it: a run of 1 actor and 1 critic rank."""
    from orlhf.config.flags import parse_config
    from orlhf.config.resolve import resolve_device
    from orlhf.storage.checkpoint_format import CheckpointError
    from orlhf.storage.ds_layout import UNIVERSAL, check_resume

    def check(**flags):
        flags = {"advantage_estimator": "gae", **flags}
        return check_resume(runs["step"], resolve_device(parse_config(flags, set(flags)), "cpu"))

    # one rank trains without ZeRO by default; the actor was saved under ZeRO-3, the critic under ZeRO-2: one refusal
    # names both roles' fixes, and that no one --zero_stage serves both on these rank counts
    with pytest.raises(CheckpointError) as err:
        check()
    actor, critic, both = str(err.value).splitlines()
    assert "this run trains the actor under ZeRO-0 on 1; ZeRO-0 neither converts nor loads" in actor
    assert actor.endswith("resume with --use_ds_universal_ckpt --zero_stage 3, or on 2 actor ranks")
    assert "critic: the critic's DeepSpeed state was saved under ZeRO-2 on 2" in critic
    assert both.startswith("no one --zero_stage (it is the same for every role) loads every role")
    # 4 actor ranks train under ZeRO-3 by default, 1 critic rank under ZeRO-2 (--adam_offload keeps ZeRO's optimizer):
    # both convert
    plans = check(use_ds_universal_ckpt=True, actor_num_gpus_per_node=4, adam_offload=True)
    assert plans == {"actor": UNIVERSAL, "critic": UNIVERSAL}
