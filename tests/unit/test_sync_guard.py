"""The sync guard's decision (orlhf/sync_guard.py): threshold by dtype, off switch, when it does not judge."""

import logging

import pytest

from orlhf.config import build_config
from orlhf.sync_guard import DEFAULT_MAX_GAP, EngineMismatchError, SyncGuard, max_gap


def test_threshold_defaults_by_dtype_and_flag_wins():
    assert max_gap(None, bf16=False) == DEFAULT_MAX_GAP["fp32"] == 1e-3
    assert max_gap(None, bf16=True) == DEFAULT_MAX_GAP["bf16"] > DEFAULT_MAX_GAP["fp32"]
    assert max_gap(0.2, bf16=False) == 0.2 and max_gap(1e-6, bf16=True) == 1e-6
    assert max_gap(0.0, bf16=False) is None and max_gap(-1.0, bf16=True) is None  # off


def test_from_flags():
    cfg = build_config({"max_engine_logprob_gap": 0.01, "bf16": True}, explicit={"max_engine_logprob_gap", "bf16"})
    guard = SyncGuard.from_config(cfg)
    assert guard.threshold == 0.01 and guard.bf16
    assert SyncGuard.from_config(build_config({}, explicit=set())).threshold == 1e-3


def test_healthy_gap_passes_broken_sync_stops_with_the_facts():
    guard = SyncGuard(threshold=1e-3)
    assert guard.check(3e-7, step=4, staleness=0) is True  # a synced fp32 engine: ~1e-7
    assert guard.check(1e-3, step=4, staleness=0) is True  # at the threshold: still fine
    with pytest.raises(EngineMismatchError) as err:
        guard.check(0.024, step=5, staleness=0)  # the tied-head gap of issue 17
    msg = str(err.value)
    for fact in ("step 5", "0.024", "--max_engine_logprob_gap 0.001", "fp32", "tied lm_head", "dtype",
                 "set it to 0"):
        assert fact in msg, fact


def test_no_judgement_where_the_gap_is_not_a_sync_fault(caplog):
    # Async rollouts from older weights differ by the policy's own update, not by a broken sync.
    assert SyncGuard(threshold=1e-3).check(0.5, step=3, staleness=1) is False
    # vLLM reports raw-logit log-probs; at temperature 0.7 the actor's differ by design. Warned once.
    hot = SyncGuard(threshold=1e-3, temperature=0.7)
    with caplog.at_level(logging.WARNING, logger="orlhf.sync_guard"):
        assert hot.check(0.5, step=1, staleness=0) is False and hot.check(0.5, step=2, staleness=0) is False
    assert sum("temperature" in r.message for r in caplog.records) == 1
    assert SyncGuard(threshold=None).check(10.0, step=1, staleness=0) is False  # --max_engine_logprob_gap 0
