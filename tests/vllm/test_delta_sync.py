"""--vllm_sync_delta over a real gloo group into a real vLLM engine (bf16, as --bf16 runs it): after every delta sync
the engine's weights equal, bit for bit, what a full sync of the same trainer weights leaves there.

    tiny random model per family (family_rig.py: Llama untied and tied, Qwen2-MoE; a LoRA adapter on Llama)
      trainer (PolicyWorker, ZeRO-3, bf16, lr 1e-5): full first sync through the delta path, then per step:
        a PPO step -> delta sync -> engine weights D, prompt log-probs -> full sync (send_weights) -> F
        D == F bit for bit (vLLM's own parameters and buffers, after its repacking), log-probs equal,
        and the delta is smaller than the full sync's bytes (few bf16 values move at this learning rate)
"""

import pytest
import torch

from orlhf.rollout.weight_sync import _nbytes
from tests.vllm.family_rig import Rig, build_models

pytestmark = [pytest.mark.vllm]
FAMILIES = ["llama", "llama_tied", "qwen2_moe"]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    paths = build_models(tmp_path_factory.mktemp("delta"), FAMILIES)
    r = Rig()
    yield paths, r
    r.close()


def _tokens() -> torch.Tensor:
    return torch.randint(4, 900, (4, 24), generator=torch.Generator().manual_seed(0))  # (B, T), no special ids


def _same_bits(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in any bit (or are missing from one side)."""
    bad = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        x, y = a[name], b[name]
        if (
            x.shape != y.shape
            or x.dtype != y.dtype
            or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        ):
            bad.append(name)
    return bad


def _steps(r: Rig, steps: int = 2) -> None:
    seqs = _tokens()
    full_bytes = sum(_nbytes(m) for m in r.metas)
    first = r.sync_delta(full=True, bf16=True)
    assert first >= full_bytes  # every tensor whole (bf16 here as the trainer), plus the counts
    for step in range(steps):
        before = r.call("trainer", "log_probs", seqs)
        assert r.call("trainer", "train_step", seqs, step) > 0
        moved = (r.call("trainer", "log_probs", seqs) - before).abs().max().item()
        sent = r.sync_delta(full=False, bf16=True)
        delta_weights, delta_lp = r.call("engine", "weights"), r.call("engine", "log_probs", seqs)
        r.sync()
        full_weights, full_lp = r.call("engine", "weights"), r.call("engine", "log_probs", seqs)
        print(f"\n  step {step + 1}: policy moved {moved:.2e}, delta {sent} bytes of a full {full_bytes}")
        assert moved > 0, "the update did not move the policy: the test would prove nothing"
        assert not _same_bits(delta_weights, full_weights), _same_bits(delta_weights, full_weights)[:5]
        assert torch.equal(delta_lp, full_lp)
        assert sent < full_bytes / 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_delta_sync_leaves_the_engine_where_a_full_sync_does(rig, family):
    paths, r = rig
    try:
        r.load(paths[family], bf16=True, lr=1e-5)
        _steps(r)
    finally:
        r.unload()


def test_with_lora_the_delta_is_over_the_adapted_modules(rig):
    """LoRA's sync plan (the adapted modules merged, and the ones the engine fuses with them) is what the delta
    diffs: the engine ends where the adapter-only full sync leaves it."""
    paths, r = rig
    try:
        r.load(paths["llama"], bf16=True, lr=1e-5, lora_rank=4)
        _steps(r, steps=1)
    finally:
        r.unload()
