"""One optimizer step's gradient is the gradient of the whole batch's loss computed at once.

Real DeepSpeed workers (ZeRO-0, where the averaged gradient sits in p.grad at the accumulation boundary) on real
gloo process groups at world size 1 and 2, micro-batch sizes 1, 3 and the whole share; the reference is the
same loss computed here on the whole batch in one forward with plain transformers. Response lengths differ from
row to row (1..5 tokens), so a mean of micro-batch means would weigh tokens unequally: a check below shows that
a mean of micro-batch means misses the reference by far more than the tolerance. The actor is configured with a KL
coefficient 5x the one its train_step is given, so the match also shows the passed (adaptive) value is used.
"""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks

from orlhf.algo.kl import approx_kl
from orlhf.algo.losses import aggregate, entropy_from_logits, policy_loss_terms, value_loss_per_token
from orlhf.config.worker_config import WorkerConfig, role_config
from orlhf.types import Experience

B, P, A, V = 12, 4, 5, 64  # global batch, prompt length, response length, vocab
ENT, KL = 0.01, 0.1
CASES = {
    1: [
        ("actor", 1, "token_mean"),
        ("actor", 3, "token_mean"),
        ("actor", 12, "token_mean"),
        ("actor", 3, "seq_mean"),
        ("critic", 1, "token_mean"),
        ("critic", 12, "token_mean"),
    ],
    2: [
        ("actor", 1, "token_mean"),
        ("actor", 3, "token_mean"),
        ("actor", 6, "token_mean"),
        ("actor", 3, "seq_mean"),
        ("critic", 1, "token_mean"),
        ("critic", 6, "token_mean"),
    ],
}


@pytest.fixture(scope="module")
def experience(model_dir) -> Experience:
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(3, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    for i in range(B):
        attn[i, P + 1 + (i * 7) % A :] = 0  # response i has 1 + 7i % 5 real tokens: 1, 3, 5, 2, 4, ...
    seq[attn == 0] = 0
    mask = attn[:, -A:].bool()
    return Experience(
        seq,
        attn,
        mask,
        action_log_probs=-2.0 - torch.rand(B, A, generator=g),
        advantages=torch.randn(B, A, generator=g),
        returns=torch.randn(B, A, generator=g),
        values=0.1 * torch.randn(B, A, generator=g),
        base_action_log_probs=-2.0 - torch.rand(B, A, generator=g),
    )


def _cfg(role: str, path: str, mb: int, mode: str) -> WorkerConfig:
    # kl_coef here is the configured initial value; the step's coefficient comes with train_step (an adaptive
    # controller moves it), and the reference uses KL: the gradients agree only if the passed value is used.
    extra = (
        dict(entropy_loss_coef=ENT, use_kl_loss=True, kl_coef=5 * KL, kl_estimator="k3")
        if role == "actor"
        else dict(value_clip=0.5)
    )
    return role_config(
        role,
        model_path=path,
        device="cpu",
        zero_stage=0,
        learning_rate=1e-3,
        train_batch_size=B,
        micro_train_batch_size=mb,
        max_norm=1e9,
        loss_agg_mode=mode,
        **extra,
    )


def _rank_main(rank: int, world: int, port: int, path: str, exp: Experience, out_dir: str) -> None:
    torch.set_num_threads(1)
    from orlhf.workers import CriticWorker, PolicyWorker

    share = exp.split([B // world] * world)[rank]
    out = {}
    for role, mb, mode in CASES[world]:
        worker = (PolicyWorker if role == "actor" else CriticWorker)(_cfg(role, path, mb, mode))
        worker.init()
        grads = {}
        step = worker.engine.step

        def capture(*a, _w=worker, _step=step, _grads=grads, **kw):  # the gradient, averaged over ranks, before Adam
            if _w.engine.is_gradient_accumulation_boundary():
                _grads.update({n: p.grad.detach().clone() for n, p in _w.module.named_parameters()})
            return _step(*a, **kw)

        worker.engine.step = capture
        stats = worker.train_step(share, KL) if role == "actor" else worker.train_step(share)
        assert role == "critic" or stats.kl_coef == KL
        out[(role, mb, mode)] = grads
    if rank == 0:
        torch.save(out, Path(out_dir) / f"ws{world}.pt")


def _spawn(world: int, root: Path, exp: Experience) -> dict:
    spawn_ranks(_rank_main, world, str(root / "lm"), exp, str(root))
    return torch.load(root / f"ws{world}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(model_dir, experience) -> dict:
    return {world: _spawn(world, model_dir, experience) for world in (1, 2)}


# ---------------------------------------------------------------- the reference: the whole batch at once


def _actor_loss(model, exp: Experience, mode: str, split: int = 1) -> torch.Tensor:
    """The actor's loss on `exp`; split > 1 gives a mean of per-micro-batch local means instead."""
    if split > 1:
        parts = exp.split([B // split] * split)
        return sum(_actor_loss(model, p, mode) for p in parts) / split
    pos = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=exp.sequences, attention_mask=exp.attention_mask, position_ids=pos).logits
    logits = logits[:, -A - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, exp.sequences[:, -A:, None]).squeeze(-1)
    m = exp.action_mask
    pol = policy_loss_terms(lp, exp.action_log_probs, exp.advantages, m, 0.2, 0.2).loss
    return (
        aggregate(pol, m, mode)
        - ENT * aggregate(entropy_from_logits(logits), m, mode)
        + KL * aggregate(approx_kl(lp, exp.base_action_log_probs, "k3"), m, mode)
    )


def _critic_loss(model, exp: Experience) -> torch.Tensor:
    v = model(input_ids=exp.sequences, attention_mask=exp.attention_mask)[:, -A - 1 : -1]
    per_token, _ = value_loss_per_token(v, exp.values, exp.returns, 0.5)
    return aggregate(per_token, exp.action_mask, "token_mean")


def _grads(model, loss) -> dict:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(model_dir, experience) -> dict:
    from transformers import AutoModelForCausalLM

    from orlhf.workers.critic import load_value_model

    lm = AutoModelForCausalLM.from_pretrained(model_dir / "lm", dtype=torch.float32)
    critic = load_value_model(_cfg("critic", str(model_dir / "lm"), 1, "token_mean"))  # same seeded value head
    return {
        "token_mean": _grads(lm, _actor_loss(lm, experience, "token_mean")),
        "seq_mean": _grads(lm, _actor_loss(lm, experience, "seq_mean")),
        "micro_means": _grads(lm, _actor_loss(lm, experience, "token_mean", split=4)),
        "critic": _grads(critic, _critic_loss(critic, experience)),
    }


def _rel_err(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[k] - want[k]).abs().max().item() for k in want) / scale


@pytest.mark.parametrize("world", [1, 2])
def test_step_gradient_equals_whole_batch_gradient(runs, reference, world):
    for (role, mb, mode), grads in runs[world].items():
        want = reference["critic"] if role == "critic" else reference[mode]
        assert _rel_err(grads, want) <= 2e-5, (world, role, mb, mode)


def test_the_old_mean_of_micro_means_is_measurably_different(reference):
    # What orlhf did before: each micro-batch (here 4 of 3 rows) its own token mean, then their mean.
    assert _rel_err(reference["micro_means"], reference["token_mean"]) > 1e-2
    assert _rel_err(reference["seq_mean"], reference["token_mean"]) > 1e-2
