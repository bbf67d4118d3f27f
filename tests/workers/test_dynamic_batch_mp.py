"""--use_dynamic_batch: token-budget micro-batches give the fixed-micro-batch update, and keep to the budget.

Real DeepSpeed actors on real gloo process groups (world size 1 and 2). Each run trains one actor from the same
weights on the same 12 samples (prompt 4 tokens, responses 1..5: real lengths 5..9) in two optimizer steps,
once with --micro_train_batch_size 3 and once by token budget; both must end with the same weights (fp32
tolerance) and, under ZeRO-0 where the step's gradient sits in p.grad, the same gradients. Budget 8 is below
the longest samples (9 tokens): those get a micro-batch of their own (OpenRLHF's first fit does the same), and
every other micro-batch holds at most 8 real tokens. Log-prob forwards by budget equal the fixed ones.
"""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks

from orlhf.config.worker_config import WorkerConfig, role_config
from orlhf.types import Experience
from orlhf.workers.batching import budget_micro_batches, first_fit_bins, real_lengths

B, P, A, V = 12, 4, 5, 64
BUDGETS = (8, 20)


@pytest.fixture(scope="module")
def experience() -> Experience:
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(3, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    for i in range(B):
        attn[i, P + 1 + (i * 7) % A :] = 0  # response i has 1 + 7i % 5 real tokens
    seq[attn == 0] = 0
    return Experience(
        seq,
        attn,
        attn[:, -A:].bool(),
        action_log_probs=-2.0 - torch.rand(B, A, generator=g),
        advantages=torch.randn(B, A, generator=g),
        returns=torch.randn(B, A, generator=g),
    )


def _cfg(path: str, zero: int, budget: int) -> WorkerConfig:
    return role_config(
        "actor",
        model_path=path,
        device="cpu",
        zero_stage=zero,
        learning_rate=1e-3,
        train_batch_size=B // 2,
        micro_train_batch_size=3,
        max_norm=1e9,
        entropy_loss_coef=0.01,
        max_tokens=budget,
        forward_max_tokens=budget,
    )


def _rank_main(rank: int, world: int, port: int, path: str, exp: Experience, out_dir: str) -> None:
    torch.set_num_threads(1)
    from orlhf.workers import PolicyWorker

    share = exp.split([B // world] * world)[rank]
    out = {}
    for zero in (0, 3):
        for budget in (0, *BUDGETS):  # 0: fixed micro-batches of 3
            worker = PolicyWorker(_cfg(path, zero, budget))
            worker.init()
            seen, grads = [], []
            lp = worker.forward_micro_batches(share.as_sequence_batch(), _recording_log_probs(worker, seen))
            micro, last = worker._train_plan(share, B // 2 // world)
            step = worker.engine.step

            def capture(*a, _w=worker, _step=step, _zero=zero, _grads=grads, **kw):  # ZeRO-0: the gradient before Adam
                if _w.engine.is_gradient_accumulation_boundary() and _zero == 0:
                    _grads.append({n: p.grad.detach().clone() for n, p in _w.module.named_parameters()})
                return _step(*a, **kw)

            worker.engine.step = capture
            before = worker.state_dict_full()
            worker.train_step(share)
            out[(zero, budget)] = {
                "before": before,
                "weights": worker.state_dict_full(),
                "grads": grads,
                "log_probs": lp,
                "forward_lengths": seen,
                "last": last,
                "train_lengths": [_lengths(m) for m in micro],
            }
    torch.save(out, Path(out_dir) / f"ws{world}-rank{rank}.pt")


def _recording_log_probs(worker, seen: list):
    from orlhf.workers.causal_lm import action_logits, gather_log_probs

    def fn(mb):
        seen.append(_lengths(mb))
        return gather_log_probs(action_logits(worker.engine, mb, 1.0), mb.sequences[:, -mb.num_actions :])

    return fn


def _lengths(mb) -> list[int]:
    prompt, response = real_lengths(mb)
    return (prompt + response).tolist()


@pytest.fixture(scope="module")
def runs(model_dir, experience) -> dict:
    out = {}
    for world in (1, 2):
        spawn_ranks(_rank_main, world, str(model_dir / "lm"), experience, str(model_dir))
        out[world] = [torch.load(model_dir / f"ws{world}-rank{r}.pt", weights_only=False) for r in range(world)]
    return out


def _max_rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[k] - want[k]).abs().max().item() for k in want) / scale


@pytest.mark.parametrize("world", [1, 2])
def test_dynamic_update_equals_fixed_update(runs, experience, world):
    rank0 = runs[world][0]
    mask = experience.split([B // world] * world)[0].action_mask  # padding positions hold garbage either way
    for zero in (0, 3):
        fixed = rank0[(zero, 0)]
        for budget in BUDGETS:
            dyn = rank0[(zero, budget)]
            assert _max_rel(dyn["weights"], fixed["weights"]) < 1e-5, (world, zero, budget)
            assert torch.allclose(dyn["log_probs"] * mask, fixed["log_probs"] * mask, atol=1e-5), (world, zero, budget)
            if zero == 0:
                assert len(dyn["grads"]) == len(fixed["grads"]) == 2  # two optimizer steps
                for got, want in zip(dyn["grads"], fixed["grads"]):
                    assert _max_rel(got, want) < 1e-5, (world, budget)
        # the update is not a no-op: the weights moved by far more than the tolerance
        assert _max_rel(fixed["weights"], fixed["before"]) > 1e-3


@pytest.mark.parametrize("world", [1, 2])
def test_budgets_are_kept_and_ranks_agree(runs, world):
    for zero in (0, 3):
        for budget in BUDGETS:
            counts = []
            for rank_out in runs[world]:
                run = rank_out[(zero, budget)]
                for group in run["train_lengths"] + run["forward_lengths"]:
                    assert sum(group) <= budget or len(group) == 1, (budget, group)
                counts.append(len(run["train_lengths"]))
                assert sum(run["last"]) == 2  # two optimizer steps, each ended once
            assert len(set(counts)) == 1  # every rank runs the same number of micro-batches
    # budget 8 < the 9-token samples: they run alone; the fixed run had 3 per micro-batch
    assert any(g == [9] for g in runs[1][0][(0, 8)]["train_lengths"])
    assert all(len(g) == 3 for g in runs[1][0][(0, 0)]["train_lengths"])


def test_first_fit_count_and_spread():
    # OpenRLHF's example: [5, 3, 7, 2, 6] in bins of 10 -> 3 bins by first fit
    assert first_fit_bins([5, 3, 7, 2, 6], 10) == 3
    groups = budget_micro_batches([5, 3, 7, 2, 6], 10)
    assert len(groups) == 3 and sorted(i for g in groups for i in g) == list(range(5))
    assert all(sum([5, 3, 7, 2, 6][i] for i in g) <= 10 for g in groups)
    # a sample over the budget is a micro-batch of its own, not an error
    assert budget_micro_batches([30, 4, 4], 10) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="budget"):
        budget_micro_batches([1], 0)
