"""--logprobs_chunk_mb on real process groups (gloo, two ranks, ZeRO-3, no Ray): the actor's log-probs and a train
step (an entropy loss term included) through the chunked LM head (workers/lm_head.py: ZeRO-3's hooks gather the
head's weight for its own call, forward and backward) equal the whole-logits path's: log-probs to 1e-6, the
weights after the step to 1e-5, the logged entropy to 1e-5."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from mp_tools import save_tiny_llama, spawn_ranks
from safetensors.torch import load_file

from orlhf.types import Experience

B, P, A, V = 8, 6, 5, 512
CHUNK_MB = V * 4 * 3 / 2**20  # 3 tokens' float32 logits a chunk: each rank's 4 x 5 action tokens in 7 chunks


def _experience() -> Experience:
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, V, (B, P + A), generator=g)
    ones = torch.ones_like(seqs)
    return Experience(seqs, ones, ones[:, P:].bool(), action_log_probs=None, advantages=torch.randn(B, A, generator=g))


def _rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    from orlhf.config.worker_config import role_config
    from orlhf.workers import PolicyWorker

    exp = _experience().index(torch.arange(rank, B, world))
    results = {}
    for name, chunk_mb in (("whole", 0.0), ("chunked", CHUNK_MB)):
        w = PolicyWorker(
            role_config(
                "actor",
                model_path=path,
                device="cpu",
                zero_stage=3,
                learning_rate=1e-2,
                train_batch_size=B,
                micro_train_batch_size=2,
                total_optimizer_steps=2,
                entropy_loss_coef=0.01,
                temperature=0.9,
                logprobs_chunk_mb=chunk_mb,
            )
        )
        w.init()
        log_probs = w.log_probs(exp.as_sequence_batch())
        stats = w.train_step(exp)
        results[name] = {"log_probs": log_probs, "entropy": stats.entropy, "weights": w.state_dict_full()}
    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))


def test_chunked_log_probs_and_train_step_equal_the_whole_logits_under_zero3(tmp_path):
    path = str(save_tiny_llama(tmp_path, V))
    spawn_ranks(_rank_main, 2, path, str(tmp_path))
    r = torch.load(tmp_path / "results.pt")
    whole, chunked = r["whole"], r["chunked"]
    assert (whole["log_probs"] - chunked["log_probs"]).abs().max() < 1e-6
    assert abs(whole["entropy"] - chunked["entropy"]) < 1e-5
    w0, start = whole["weights"], load_file(os.path.join(path, "model.safetensors"))
    assert max((w0[k] - start[k]).abs().max().item() for k in w0) > 1e-3  # the step moved the weights
    assert all((w0[k] - chunked["weights"][k]).abs().max() < 1e-5 for k in w0)
