"""OpenRLHF's DeepSpeed knobs in real workers (gloo, two ranks, ZeRO-3, no Ray): an actor with --gradient_checkpointing
--gradient_checkpointing_use_reentrant --overlap_comm --zpg 2 --full_determinism trains through torch's reentrant
checkpoint, DeepSpeed's hierarchical (ZeRO++) partitions and deterministic kernels, and lands on the weights of the
same step without them (same math; float summation order aside)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from mp_tools import save_tiny_llama, spawn_ranks

from orlhf.types import Experience

# A vocabulary large enough that the embedding and the LM head (V x 32) pass ZeRO-3's persistence threshold (1e5
# elements): they are partitioned, and released to their secondary partitions after each gather.
B, P, A, V = 8, 6, 5, 4096


def _experience() -> Experience:
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, V, (B, P + A), generator=g)
    ones = torch.ones_like(seqs)
    return Experience(seqs, ones, ones[:, P:].bool(), action_log_probs=None, advantages=torch.randn(B, A, generator=g))


def _rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    import torch.utils.checkpoint as ckpt

    from orlhf.config.worker_config import role_config
    from orlhf.workers import PolicyWorker

    reentrant_calls = []
    apply = ckpt.CheckpointFunction.apply  # the reentrant checkpoint's entry point
    ckpt.CheckpointFunction.apply = staticmethod(lambda *a: reentrant_calls.append(1) or apply(*a))

    def trained(**knobs) -> tuple:
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
                gradient_checkpointing=True,
                **knobs,
            )
        )
        w.init()
        seen = {
            "hpz": w.engine.zero_hpz_partition_size(),
            "overlap": w.engine.zero_overlap_comm(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        }
        params = list(w.module.parameters())
        seen["hpz_group"] = {getattr(p, "ds_zero_param_process_group", None) is not None for p in params}
        # partitioned at load (DeepSpeed drops them at each optimizer step and partitions again at the next release)
        seen["secondary"] = sum(getattr(p, "ds_secondary_tensor", None) is not None for p in params)
        before = len(reentrant_calls)
        w.train_step(_experience().index(torch.arange(rank, B, world)))
        seen["reentrant_calls"] = len(reentrant_calls) - before
        return seen, w.state_dict_full()

    plain, plain_weights = trained()  # first: --full_determinism stays on in this process once set
    knobs, knob_weights = trained(
        gradient_checkpointing_use_reentrant=True, overlap_comm=True, zpg=2, full_determinism=True
    )
    if rank == 0:
        torch.save({"plain": plain, "knobs": knobs, "w_plain": plain_weights, "w_knobs": knob_weights}, out)


def test_the_knobs_run_in_a_zero3_actor_and_change_no_update(tmp_path):
    path = str(save_tiny_llama(tmp_path, V))
    spawn_ranks(_rank_main, 2, path, str(tmp_path / "seen.pt"))
    seen = torch.load(tmp_path / "seen.pt")
    plain, knobs = seen["plain"], seen["knobs"]
    assert plain["hpz"] == 1 and plain["hpz_group"] == {False} and not plain["secondary"]
    assert plain["reentrant_calls"] == 0
    assert not plain["deterministic"] and plain["cublas"] is None
    assert knobs["hpz"] == 2 and knobs["hpz_group"] == {True}  # ZeRO++: every parameter has its group
    assert knobs["secondary"] >= 2  # the partitioned ones (embedding, LM head) hold their secondary partitions
    assert knobs["overlap"] and knobs["reentrant_calls"] > 0
    assert knobs["deterministic"] and knobs["cublas"] == ":16:8"
    w_plain, w_knobs = seen["w_plain"], seen["w_knobs"]
    assert w_plain.keys() == w_knobs.keys()
    from safetensors.torch import load_file

    start = load_file(os.path.join(path, "model.safetensors"))
    assert max((w_plain[k] - start[k].float()).abs().max().item() for k in start) > 1e-3  # the step moved them
    assert max((w_plain[k] - w_knobs[k]).abs().max().item() for k in w_plain) < 1e-6
