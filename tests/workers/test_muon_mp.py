"""--actor_optim muon (OpenRLHF 0.11's --actor.optim muon) on a real DeepSpeed engine (one gloo rank, ZeRO-2 and
ZeRO-3): DeepSpeed's MuonWithAuxAdam steps the 2-D weights at --actor_muon_lr and the rest (embeddings, head, norms)
with the actor's AdamW settings; a step moves both halves, and the LR schedule drives both groups."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import save_tiny_llama, spawn_ranks

from orlhf.types import Experience

V = 128


def _rank_main(rank: int, world: int, port: int, path: str, stage: int, out: str) -> None:
    from orlhf.config.worker_config import role_config
    from orlhf.workers import PolicyWorker

    w = PolicyWorker(
        role_config(
            "actor",
            model_path=path,
            device="cpu",
            zero_stage=stage,
            learning_rate=1e-3,
            train_batch_size=4,
            micro_train_batch_size=4,
            total_optimizer_steps=4,
            optim="muon",
            muon_lr=0.02,
            lr_scheduler="constant",
            max_norm=0.0,  # no clipping: DeepSpeed clips after Newton-Schulz, which would shrink Muon's step
        )
    )
    w.init()
    groups = [(g.get("name"), g["lr"], g.get("use_muon")) for g in w.engine.optimizer.param_groups]
    before = w.state_dict_full()
    seqs = torch.randint(1, V, (4, 12), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(seqs)
    adv = torch.randn(4, 11, generator=torch.Generator().manual_seed(1))
    w.train_step(Experience(seqs, ones, ones[:, 1:].bool(), action_log_probs=None, advantages=adv))
    after = w.state_dict_full()
    torch.save({"groups": groups, "before": before, "after": after}, os.path.join(out, "r.pt"))


@pytest.mark.parametrize("stage", [2, 3])
def test_muon_steps_the_matrices_and_adam_the_rest(tmp_path, stage):
    path = str(save_tiny_llama(tmp_path, V))
    spawn_ranks(_rank_main, 1, path, stage, str(tmp_path))
    r = torch.load(tmp_path / "r.pt")
    lrs = {use_muon: lr for _name, lr, use_muon in r["groups"]}
    assert lrs == {True: 0.02, False: 1e-3}  # DeepSpeed's Muon and auxiliary-Adam groups at their own LRs
    moved = {k: (r["after"][k] - r["before"][k]).abs().max().item() for k in r["before"]}
    # Muon's step: lr x an orthogonalized matrix (entries about 1/sqrt(32) for these 32 x 32 projections)
    assert moved["model.layers.0.self_attn.q_proj.weight"] > 2e-3
    assert 1e-4 < moved["model.norm.weight"] <= 1.01e-3  # AdamW's first step moves each weight by about its lr
