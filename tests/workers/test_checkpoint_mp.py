"""Worker checkpoints on a real process group (gloo, world size 2, ZeRO-3, no Ray): a resumed run continues
bit-for-bit.

One spawn of two ranks (the tiny model and helpers come from test_workers_mp). Each rank runs:

    reference: actor + critic init -> 2 train steps -> RNG draws -> save_checkpoint(<tmp>/<role>)
               -> rank 0 commits the folder as the driver would -> RNG draws -> 2 more train steps
    resumed:   fresh actor + critic init -> load_checkpoint(latest()/<role>), with torch.load spied on
               -> RNG draws -> the same 2 train steps

Expected equal bit-for-bit, not just close: the resumed engine gets the same fp32 ZeRO partitions, Adam moments,
step counts and LR-scheduler position, and the CPU kernels are deterministic for a fixed thread count, so the
same inputs give the same floats. The LR changes every step here (warm-up then cosine), so a scheduler that did
not come back would show.
"""

import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks
from test_workers_mp import A, B, _cfg, _hf_log_probs, _make_batch, _tiny_llama_config, _tiny_tokenizer

from orlhf.types import Experience

ROLES = ("actor", "critic")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("ckpt_workers")
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config())
    model.save_pretrained(root / "lm")
    _tiny_tokenizer().save_pretrained(root / "lm")
    batch = _make_batch()
    old = _hf_log_probs(model.eval(), batch)
    g = torch.Generator().manual_seed(7)
    exp = Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=old,
        advantages=torch.randn(B, A, generator=g),
        returns=torch.randn(B, A, generator=g),
        values=0.1 * torch.randn(B, A, generator=g),
        base_action_log_probs=old - 0.1,
    )
    return {"root": root, "lm": str(root / "lm"), "exp": exp}


def _workers(lm: str) -> dict:
    from orlhf.workers import CriticWorker, PolicyWorker

    # warm-up over 2 of the 4 optimizer steps, then cosine: a different LR at every step
    workers = {
        "actor": PolicyWorker(_cfg("actor", lm, lr_warmup_ratio=0.5)),
        "critic": CriticWorker(_cfg("critic", lm, lr_warmup_ratio=0.5)),
    }
    for w in workers.values():
        w.init()
    return workers


def _steps(workers: dict, exp: Experience, rank: int, steps: range) -> dict:
    """Train steps on a different shuffle of the batch each step; this rank takes half (one optimizer step)."""
    out = {role: [] for role in workers}
    for k in steps:
        share = exp.index(torch.randperm(B, generator=torch.Generator().manual_seed(100 + k))).split([B // 2] * 2)
        for role, w in workers.items():
            s = w.train_step(share[rank])
            out[role].append((s.loss, s.lr, s.grad_norm))
    return out


def _finish(workers: dict) -> dict:
    return {
        role: {
            "state": w.state_dict_full(),
            "counters": (w.engine.global_steps, w.engine.global_samples, w.engine.micro_steps, w.engine.skipped_steps),
        }
        for role, w in workers.items()
    }


def _draw() -> tuple:
    import random

    import numpy as np

    return torch.rand(4 + torch.distributed.get_rank()).tolist(), random.random(), float(np.random.rand())


def _rank_main(rank: int, world: int, port: int, setup: dict, out_dir: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    import torch.distributed as dist

    from orlhf.storage.checkpoint import CheckpointManager
    from orlhf.storage.checkpoint_format import CheckpointError

    exp, out = setup["exp"], {}
    mgr = CheckpointManager(setup["root"] / "ck", max_ckpt_num=2)

    # ---- reference: 2 steps, save, 2 steps
    workers = _workers(setup["lm"])
    _steps(workers, exp, rank, range(2))
    _draw()  # as dropout or sampling would: the RNGs at the save are not the ones a fresh init seeds
    tmp = [mgr.begin(2) if rank == 0 else None]  # the driver's part, played by rank 0
    dist.broadcast_object_list(tmp, src=0)
    for role, w in workers.items():
        w.save_checkpoint(str(tmp[0] / role))
    if rank == 0:
        mgr.commit(tmp[0], 2, {"fingerprint": {}, "roles": {role: world for role in ROLES}})
    dist.barrier()
    out["ref_draw"] = _draw()
    out["ref"] = _steps(workers, exp, rank, range(2, 4))
    out["ref_end"] = _finish(workers)

    # ---- resumed: fresh workers, load, the same 2 steps
    workers = _workers(setup["lm"])
    try:
        workers["actor"].load_checkpoint(str(setup["root"] / "nothing_here"))
    except CheckpointError as e:  # raised on every rank before any collective: nothing hangs
        out["empty_error"] = str(e)
    latest, calls, real_load = mgr.latest(), [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    torch.load = spy
    try:
        for role, w in workers.items():
            w.load_checkpoint(str(latest / role))
    finally:
        torch.load = real_load
    out["load_weights_only"] = calls
    out["resumed_draw"] = _draw()
    out["resumed"] = _steps(workers, exp, rank, range(2, 4))
    out["resumed_end"] = _finish(workers)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(setup) -> list[dict]:
    out_dir = setup["root"] / "out"
    out_dir.mkdir()
    spawn_ranks(_rank_main, 2, setup, str(out_dir))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]  # our own test output


def test_resumed_steps_equal_the_uninterrupted_ones(ranks):
    for out in ranks:
        for role in ROLES:
            ref, got = out["ref"][role], out["resumed"][role]
            assert got == ref, f"{role}: (loss, lr, grad_norm) per step differ: {got} vs {ref}"
            assert all(math.isfinite(x) for step in ref for x in step)
            lrs = [lr for _, lr, _ in ref]
            assert lrs[0] != lrs[1]  # the schedule moves between the resumed steps
            assert out["resumed_end"][role]["counters"] == out["ref_end"][role]["counters"]
    # both ranks computed the same global step (their losses differ: each saw its own half)
    assert [s[1:] for s in ranks[0]["ref"]["actor"]] == [s[1:] for s in ranks[1]["ref"]["actor"]]


def test_resumed_final_weights_are_bit_identical(ranks):
    for role in ROLES:
        ref, got = ranks[0]["ref_end"][role]["state"], ranks[0]["resumed_end"][role]["state"]
        assert ref.keys() == got.keys() and len(ref) > 0
        unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not unequal, f"{role}: {unequal}"
    assert ranks[1]["ref_end"]["actor"]["state"] is None  # full state dicts live on rank 0


def test_worker_rng_is_restored_per_rank(ranks):
    for out in ranks:
        assert out["resumed_draw"] == out["ref_draw"]  # torch, python random, numpy


def test_every_load_is_weights_only(ranks):
    for out in ranks:
        # per role: DeepSpeed's model-states file and this rank's ZeRO optimizer shard
        assert len(out["load_weights_only"]) >= 2 * len(ROLES)
        assert all(w is True for w in out["load_weights_only"]), out["load_weights_only"]


def test_checkpoint_layout_and_errors(ranks, setup):
    ck = setup["root"] / "ck"
    assert [p.name for p in ck.iterdir()] == ["step_000002"]
    actor = ck / "step_000002" / "actor"
    assert (actor / "latest").read_text() == "global_step2"
    names = {p.name for p in (actor / "global_step2").iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= names  # every rank's shard
    assert {"rng_rank0.json", "rng_rank1.json"} <= {p.name for p in actor.iterdir()}
    for out in ranks:
        assert "nothing_here: written by 0 actor ranks, this group has 2" in out["empty_error"]


def test_safe_load_refuses_pickled_code(tmp_path):
    import pickle

    from orlhf.storage.checkpoint_state import safe_torch_load

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"x": torch.ones(1), "evil": Boom()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only|Unsupported global"):
        safe_torch_load(tmp_path / "evil.pt")
