"""--enable_ema on real process groups (gloo, two ranks, ZeRO-3, no Ray): the exported actor is the moving average
of the trained weights, computed by hand here from the weights after each step; exporting leaves the trained
weights as they were; a checkpoint carries the average, so a resumed worker exports the same one.

Each rank trains two optimizer steps (ratio 1, single pass), recording the full weights before and after each; then
exports (save_hf), checkpoints, and a fresh worker loads the checkpoint and exports again.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from mp_tools import save_tiny_llama, spawn_ranks
from safetensors.torch import load_file

from orlhf.types import Experience

B, P, A, V, BETA = 8, 6, 5, 128, 0.9


def _experience(seed: int) -> Experience:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(1, V, (B, P + A), generator=g)
    ones = torch.ones_like(seqs)
    return Experience(seqs, ones, ones[:, P:].bool(), action_log_probs=None, advantages=torch.randn(B, A, generator=g))


def _rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    from orlhf.config.worker_config import role_config
    from orlhf.workers import PolicyWorker

    def worker():
        w = PolicyWorker(
            role_config(
                "actor",
                model_path=path,
                device="cpu",
                zero_stage=3,
                learning_rate=1e-2,
                train_batch_size=B,
                micro_train_batch_size=2,
                total_optimizer_steps=4,
                ema_beta=BETA,
            )
        )
        w.init()
        return w

    actor = worker()
    weights = [actor.state_dict_full()]
    for step in range(2):
        actor.train_step(_experience(step).index(torch.arange(rank, B, world)))
        weights.append(actor.state_dict_full())
    actor.save_hf(os.path.join(out, "export"))
    after_export = actor.state_dict_full()
    actor.save_checkpoint(os.path.join(out, "ckpt"))
    resumed = worker()
    resumed.load_checkpoint(os.path.join(out, "ckpt"))
    resumed.save_hf(os.path.join(out, "export_resumed"))
    if rank == 0:
        torch.save({"weights": weights, "after_export": after_export}, os.path.join(out, "trajectory.pt"))


def test_the_export_is_the_moving_average_and_a_checkpoint_carries_it(tmp_path):
    path = str(save_tiny_llama(tmp_path, V))
    spawn_ranks(_rank_main, 2, path, str(tmp_path))
    saved = torch.load(tmp_path / "trajectory.pt")
    w0, w1, w2 = saved["weights"]
    # avg_0 = w0; avg_k = beta * avg_(k-1) + (1 - beta) * w_k  (OpenRLHF's moving_average, once per optimizer step)
    expected = {k: BETA * (BETA * w0[k] + (1 - BETA) * w1[k]) + (1 - BETA) * w2[k] for k in w0}
    exported = load_file(tmp_path / "export" / "model.safetensors")
    moved = max((w2[k] - w0[k]).abs().max().item() for k in w0)
    assert moved > 1e-3, "training did not move the weights: the average would prove nothing"
    assert max((exported[k].float() - expected[k]).abs().max().item() for k in exported) < 1e-6
    assert any((exported[k].float() - w2[k]).abs().max().item() > 1e-4 for k in exported)  # not the trained weights
    assert all(torch.equal(saved["after_export"][k], w2[k]) for k in w2)  # exporting put the weights back
    resumed = load_file(tmp_path / "export_resumed" / "model.safetensors")
    assert all(torch.equal(resumed[k], exported[k]) for k in exported)
