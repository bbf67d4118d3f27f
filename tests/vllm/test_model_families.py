"""After a real update and a real sync, a real vLLM engine equals the trainer, for every model family.

    tiny random model per family (2 layers, hidden 64, the demo's BPE tokenizer)
      trainer: PolicyWorker (ZeRO-3, world 1; also ZeRO-0, the one-rank default, and ZeRO-2 for tied Llama and
               Qwen2-MoE):
               one PPO step + seeded noise on every weight (unrouted experts too)
      --gloo sync (orlhf's WeightSender / worker extension)--> in-process vLLM engine (fp32)
      engine prompt log-probs of fixed tokens == trainer log-probs (< 1e-5)

Families: Llama untied and tied, GPT-2 (tied, Conv1D), Gemma 2/3 (tied, soft-capping), Qwen2, Qwen3 (tied),
Mistral, Phi-3, Qwen2-MoE, Mixtral and Qwen3-MoE (fused experts at run time, per-expert names on disk). The breaks
it guards against: tied models keeping the step-0 head (gap 0.45-0.56 here), Qwen2-MoE reading raw experts as
pre-packed ones (0.058), Mixtral's first sync failing on the fused names. One trainer and one engine process serve
all families (rig in family_rig.py); each family costs one DeepSpeed init and one vLLM start.
"""

from pathlib import Path

import pytest
import torch

from orlhf.trainer.sync_guard import EngineMismatchError, SyncGuard
from tests.vllm.family_rig import FAMILIES, Rig, build_models

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    paths = build_models(tmp_path_factory.mktemp("families"), FAMILIES)
    r = Rig()
    yield paths, r
    r.close()


def _tokens() -> torch.Tensor:
    return torch.randint(4, 900, (4, 24), generator=torch.Generator().manual_seed(0))  # (B, T), no special ids


def _update_and_sync(r: Rig, path: str, zero_stage: int = 3):
    """Load, update every weight through the trainer's worker, sync.

    Returns (trainer log-probs, engine log-probs after the sync, how far the policy moved, engine log-probs
    before the sync): (B, T-1) each."""
    seqs = _tokens()
    r.load(path, zero_stage=zero_stage)
    before = r.call("trainer", "log_probs", seqs)
    assert r.call("trainer", "train_step", seqs) > 0  # a real PPO step (gradients flowed)
    r.call("trainer", "perturb", 1)  # and every parameter moves, experts no token was routed to included
    after = r.call("trainer", "log_probs", seqs)
    stale = r.call("engine", "log_probs", seqs)
    r.sync()
    # the coverage check (rollout/weight_sync.py) passes a whole sync of every family: nothing left out
    assert r.call("engine", "not_loaded") == []
    return after, r.call("engine", "log_probs", seqs), (after - before).abs().max().item(), stale


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_equals_trainer_after_sync(rig, family):
    paths, r = rig
    try:
        trainer, engine, moved, _ = _update_and_sync(r, paths[family])
        gap = (engine - trainer).abs().max().item()
        print(f"\n[{family}] policy moved {moved:.3f}, engine - trainer after sync: {gap:.2e}")
        assert moved > 0.05, "the update did not move the policy: the test would prove nothing"
        assert gap < 1e-5
    finally:
        r.unload()


@pytest.mark.parametrize("zero_stage", [0, 2])
@pytest.mark.parametrize("family", ["llama_tied", "qwen2_moe"])
def test_engine_equals_a_one_rank_trainer_after_sync(rig, family, zero_stage):
    """A one-rank actor group trains without ZeRO by default in fp32, under ZeRO-2 in bf16 or where it needs
    ZeRO's optimizer (worker_config.zero_stage_of): its sync, for a tied head and for packed experts, the two
    families that once diverged, must reach the engine exactly too."""
    paths, r = rig
    try:
        trainer, engine, moved, _ = _update_and_sync(r, paths[family], zero_stage=zero_stage)
        assert moved > 0.05, "the update did not move the policy: the test would prove nothing"
        assert (engine - trainer).abs().max().item() < 1e-5
    finally:
        r.unload()


def test_sync_guard_trips_on_a_skipped_sync_and_passes_after_it(rig):
    """The guard's quantity (mean |engine - actor| per token) on a real engine: stale weights trip it (the flag's
    threshold here; the calibrated one: test_sync_guard_breaks.py)."""
    paths, r = rig
    guard = SyncGuard(flag=1e-3)
    try:
        trainer, engine, _, stale = _update_and_sync(r, paths["llama_tied"])
        with pytest.raises(EngineMismatchError, match="step 2"):
            guard.check((stale - trainer).abs().mean().item(), step=2, staleness=0)  # engine never synced
        assert guard.check((engine - trainer).abs().mean().item(), step=2, staleness=0)
    finally:
        r.unload()


def _sampled_gap(r: Rig, seed: int, temperature: float = 1.0) -> float:
    """The guard's statistic on tokens the engine sampled: mean |engine - trainer| log-prob per sampled token."""
    prompts = torch.randint(4, 900, (16, 8), generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, engine = r.call("engine", "sample", prompts, 16, seed, temperature)
    return (engine - r.call("trainer", "log_probs", seqs)[:, -16:]).abs().mean().item()


def test_engine_log_probs_at_temperature_are_the_actors(rig):
    """At --temperature 0.7 the engine reports processed (after-temperature) log-probs, the actor scores
    logits / 0.7: they agree as at temperature 1, so the guard and the IS correction can use them. With vLLM's
    default raw log-probs they differed by the temperature itself."""
    paths, r = rig
    try:
        r.load(paths["llama"], temperature=0.7)
        r.call("trainer", "train_step", _tokens())
        r.sync()
        gap = _sampled_gap(r, 3, temperature=0.7)
        print(f"\n[temperature 0.7] engine - trainer on sampled tokens: {gap:.2e}")
        assert gap < 1e-5
        assert SyncGuard(flag=1e-3, temperature=0.7).check(gap, step=2, staleness=0)
    finally:
        r.unload()


def _bytes(metas) -> int:
    from orlhf.rollout.weight_sync import _nbytes

    return sum(_nbytes(m) for m in metas)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2_moe", "gpt2"])
def test_lora_engine_samples_the_adapted_policy_after_sync(rig, family):
    """LoRA (all-linear, rank 4): a real PPO step and seeded noise on the adapter, then a sync of only the adapted
    modules, merged (plus vLLM's fused siblings; GPT-2's engine model declares no fused map: whole layers). The
    engine equals the trainer as tightly as after a full sync, and the reference the actor scores with its
    adapter off is the base model the engine held before the sync. Untied, tied, MoE, Conv1D. The merged export
    (--lora_save_merged), loaded by a fresh engine, scores as the trainer does."""
    paths, r = rig
    try:
        seqs = _tokens()
        r.load(paths[family], lora_rank=4)
        base_engine = r.call("engine", "log_probs", seqs)  # the engine starts from the base weights
        before = r.call("trainer", "log_probs", seqs)
        assert r.call("trainer", "train_step", seqs) > 0
        r.call("trainer", "perturb", 1, 0.2)  # the adapter's parameters only (the rest is frozen)
        after = r.call("trainer", "log_probs", seqs)
        reference = r.call("trainer", "base_log_probs", seqs)
        r.sync()
        engine = r.call("engine", "log_probs", seqs)
        gap = (engine - after).abs().max().item()
        full = sum(f.stat().st_size for f in Path(paths[family]).glob("*.safetensors"))
        print(
            f"\n[{family} LoRA] moved {(after - before).abs().max().item():.3f}, engine - trainer {gap:.2e}, "
            f"reference - base engine {(reference - base_engine).abs().max().item():.2e}, "
            f"sent {_bytes(r.metas)} of {full} bytes"
        )
        assert (after - before).abs().max().item() > 0.05, "the update did not move the policy"
        assert gap < 1e-5
        assert (reference - base_engine).abs().max().item() < 1e-5
        assert _bytes(r.metas) < full  # embeddings, head and norms stay where they are
        if family == "llama":  # the merged export is a plain model a fresh engine serves as the trainer scores
            merged = str(Path(paths[family]).parent / "llama-merged")
            r.call("trainer", "save_merged", merged)
            r.call("engine", "unload")
            r.call("engine", "load", merged)
            assert (r.call("engine", "log_probs", seqs) - after).abs().max().item() < 1e-5
    finally:
        r.unload()
