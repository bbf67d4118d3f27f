"""The sync guard's decision (orlhf/trainer/sync_guard.py): threshold by dtype, off switch, when it does not judge."""

import logging

import pytest

from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.trainer.sync_guard import DEFAULT_MAX_GAP, EngineMismatchError, SyncGuard, max_gap


def test_threshold_defaults_by_dtype_and_flag_wins():
    assert max_gap(None, bf16=False) == DEFAULT_MAX_GAP["fp32"] == 1e-3
    assert max_gap(0.2, bf16=False) == 0.2 and max_gap(1e-6, bf16=True) == 1e-6
    assert max_gap(0.0, bf16=False) is None and max_gap(-1.0, bf16=True) is None  # off
    # GPUs: the engines run bf16 even for an fp32 trainer, so fp32's 1e-3 would stop healthy runs there
    assert max_gap(None, bf16=False, device="cuda") == max_gap(None, bf16=True, device="cuda") == 2e-2
    assert max_gap(0.5, bf16=False, device="cuda") == 0.5


def test_bf16_default_between_healthy_and_broken_bf16_syncs():
    # Measured: a healthy bf16 sync gives <= 1.4e-3 per token (the demo's train-ppo --bf16); broken syncs
    # (tests/vllm/family_rig.py) gave 7.1e-3 (Qwen2-MoE), 2.4e-2 (tied Llama), 3.1e-2 (Gemma 3), 4.9e-2 (GPT-2).
    # A default of 5e-2 would let all of them train on.
    bf16 = max_gap(None, bf16=True)
    assert bf16 == DEFAULT_MAX_GAP["bf16"] and DEFAULT_MAX_GAP["fp32"] < bf16
    guard = SyncGuard(threshold=bf16, bf16=True)
    assert guard.check(1.4e-3, step=1, staleness=0)
    for broken in (7.1e-3, 2.4e-2, 3.1e-2, 4.9e-2):
        with pytest.raises(EngineMismatchError, match=r"\(bf16\)"):
            guard.check(broken, step=1, staleness=0)
    assert 2 * 1.4e-3 <= bf16 <= 7.1e-3 / 2  # a margin on both sides


def test_from_flags():
    cfg = build_config({"max_engine_logprob_gap": 0.01, "bf16": True}, explicit={"max_engine_logprob_gap", "bf16"})
    guard = SyncGuard.from_config(resolve_device(cfg, "cpu"))
    assert guard.threshold == 0.01 and guard.bf16
    assert SyncGuard.from_config(resolve_device(build_config({}, explicit=set()), "cpu")).threshold == 1e-3
    assert SyncGuard.from_config(resolve_device(build_config({}, explicit=set()), "cuda")).threshold == 2e-2


def test_healthy_gap_passes_broken_sync_stops_with_the_facts():
    guard = SyncGuard(threshold=1e-3)
    assert guard.check(3e-7, step=4, staleness=0) is True  # a synced fp32 engine: ~1e-7
    assert guard.check(1e-3, step=4, staleness=0) is True  # at the threshold: still fine
    with pytest.raises(EngineMismatchError) as err:
        guard.check(0.024, step=5, staleness=0)  # the gap of a sync that missed a tied head
    msg = str(err.value)
    for fact in ("step 5", "0.024", "--max_engine_logprob_gap 0.001", "fp32", "tied lm_head", "dtype", "set it to 0"):
        assert fact in msg, fact


def test_no_judgement_where_the_gap_is_not_a_sync_fault(caplog):
    # Async rollouts from older weights differ by the policy's own update, not by a broken sync.
    assert SyncGuard(threshold=1e-3).check(0.5, step=3, staleness=1) is False
    # At --temperature 0.7 the engines report processed (after-temperature) log-probs, as the actor: judged.
    with pytest.raises(EngineMismatchError):
        SyncGuard(threshold=1e-3, temperature=0.7).check(0.5, step=1, staleness=0)
    # ... unless top-p truncates them too: the actor scores the full distribution.
    assert SyncGuard(threshold=1e-3, temperature=0.7, top_p=0.9).check(0.5, step=1, staleness=0) is False
    assert SyncGuard(threshold=1e-3, top_p=0.9).check(2e-4, step=1, staleness=0) is True  # raw at temperature 1
    assert SyncGuard(threshold=None).check(10.0, step=1, staleness=0) is False  # --max_engine_logprob_gap 0


def _announced(caplog, **kw) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        SyncGuard(threshold=1e-3, **kw).announce()
    return [r.getMessage() for r in caplog.records]


def test_where_the_guard_does_not_look_is_said_at_the_start(caplog):
    (off,) = _announced(caplog, temperature=0.7, top_p=0.9)
    assert "not checked in this run" in off and "--temperature 0.7" in off and "--top_p 0.9" in off
    (stale,) = _announced(caplog, async_train=True)
    assert "--async_train" in stale and "staleness 0" in stale
    assert _announced(caplog, temperature=0.7) == [] and _announced(caplog) == []


def test_the_controller_announces_at_construction(caplog, tmp_path):
    from tests.unit.test_controller_guard import make

    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        make(tmp_path, temperature=0.7, top_p=0.9)
    assert sum("not checked in this run" in r.getMessage() for r in caplog.records) == 1


def test_engines_report_after_temperature_log_probs_off_temperature_1():
    """What the guard compares at --temperature != 1 (the engine side is run in tests/vllm/test_model_families.py)."""
    from orlhf.rollout.engine_config import engine_config, engine_logprobs_mode

    assert engine_logprobs_mode(1.0) == "raw_logprobs"  # vLLM's default: log_softmax(logits), the actor's at T 1
    assert engine_logprobs_mode(0.7) == "processed_logprobs"  # log_softmax(logits / 0.7), the actor's at T 0.7
    cfg = build_config({"temperature": 0.7, "device": "cpu"}, explicit={"temperature", "device"})
    assert engine_config(cfg).logprobs_mode == "processed_logprobs"


def test_a_nan_gap_never_passes():
    """NaN compares false both ways: `gap > threshold` let a diverged run's NaN gap through."""
    with pytest.raises(EngineMismatchError):
        SyncGuard(threshold=1e-3).check(float("nan"), step=2, staleness=0)
