"""The sync guard's decision (orlhf/trainer/sync_guard.py): the threshold calibrated on the run's first step (a
multiple of its healthy gap plus a floor, refused above a ceiling), the flag as an override, the calibration kept
by a checkpoint, and where the guard does not judge. The gaps in the comments were measured on this project's CPU
(benchmarks/results/2026-12-02-sync-guard-calibration.md)."""

import logging

import pytest

from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.trainer.sync_guard import CEILING, FLOOR, MULTIPLE, EngineMismatchError, SyncGuard, calibrated, kernels


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "orlhf.trainer.sync_guard"]


def test_threshold_is_a_multiple_of_the_healthy_gap_plus_a_floor():
    assert (MULTIPLE, FLOOR) == (4.0, 1e-4)
    assert calibrated(2e-7) == pytest.approx(1.008e-4)  # fp32 tiny model: 4 x 2e-7 + 1e-4, the floor dominates
    assert calibrated(1.5e-5) == pytest.approx(1.6e-4)  # fp32 SmolLM2-135M: 4 x 1.5e-5 + 1e-4
    assert calibrated(6.2e-4) == pytest.approx(2.58e-3)  # bf16 tiny Llama: 4 x 6.2e-4 + 1e-4
    assert calibrated(0.042) == pytest.approx(0.1681)  # bf16 SmolLM2-135M: 4 x 0.042 + 1e-4
    assert CEILING == {"fp32": 1e-3, "bf16": 0.2}


def test_first_check_calibrates_and_says_so(caplog):
    guard = SyncGuard(bf16=True)
    assert guard.threshold is None  # nothing measured yet
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        assert guard.check(6.2e-4, step=1, staleness=0, version=0)
    assert guard.healthy == 6.2e-4 and guard.threshold == pytest.approx(2.58e-3)
    assert said(caplog) == [
        "sync guard: healthy engine gap 0.00062 per token at step 1 (this model, bf16 on cpu); stopping past 0.0026"
    ]
    caplog.clear()
    assert guard.check(1.07e-3, step=9, staleness=0, version=8)  # the healthy gap drifting as the policy trains
    assert said(caplog) == []  # calibrated once


@pytest.mark.parametrize(
    "bf16, healthy, drifted, broken, case",
    [
        (False, 2e-7, 2.3e-7, 5.7e-3, "fp32 tiny Qwen2-MoE, experts read raw as pre-packed"),
        (False, 1.5e-5, 1.6e-5, 7.8e-4, "fp32 SmolLM2-135M, an engine one update behind at lr 1e-6"),
        (True, 6.7e-4, 1.07e-3, 5.9e-3, "bf16 tiny Qwen2-MoE, experts read raw as pre-packed"),
        (True, 6.2e-4, 9.5e-4, 0.079, "bf16 tiny Llama, a layer the sync missed"),
    ],
)
def test_calibrated_threshold_passes_the_healthy_drift_and_stops_the_break(bf16, healthy, drifted, broken, case):
    guard = SyncGuard(bf16=bf16)
    guard.check(healthy, step=1, staleness=0, version=0)
    assert guard.check(drifted, step=2, staleness=0, version=1)
    with pytest.raises(EngineMismatchError) as err:
        guard.check(broken, step=2, staleness=0, version=1)
    msg = str(err.value)
    for fact in ("step 2", f"{broken:.3g}", "calibrated on this run's healthy gap", f"{healthy:.2g}", "tied lm_head"):
        assert fact in msg, (case, fact)


def test_a_real_bf16_model_is_no_longer_stopped_at_step_1():
    """SmolLM2-135M with --bf16: a healthy gap of 0.042 per token; the former fixed bf16 threshold 3e-3 stopped it."""
    guard = SyncGuard(bf16=True)
    assert guard.check(0.042, step=1, staleness=0, version=0)
    assert guard.check(0.06, step=2, staleness=0, version=1)
    with pytest.raises(EngineMismatchError):
        guard.check(0.25, step=2, staleness=0, version=1)


@pytest.mark.parametrize("bf16, device, gap", [(False, "cpu", 2e-3), (True, "cpu", 0.25), (False, "cuda", 0.25)])
def test_engines_that_disagree_before_any_sync_stop_at_step_1(bf16, device, gap):
    """The engines load the folder the actor loads: past the ceiling the difference is theirs from the start (0.25:
    vLLM given another RoPE base than the trainer, SmolLM2-135M), and calibrating on it would hide it."""
    guard = SyncGuard(bf16=bf16, device=device)
    with pytest.raises(EngineMismatchError) as err:
        guard.check(gap, step=1, staleness=0, version=0)
    msg = str(err.value)
    ceiling = CEILING["bf16" if bf16 or device == "cuda" else "fp32"]
    for fact in ("step 1", f"{gap:.3g}", "before any weight sync", f"past {ceiling:g}", "--max_engine_logprob_gap"):
        assert fact in msg, fact
    assert guard.healthy is None


def test_kernels_name_both_dtypes_where_they_differ():
    assert kernels(False, "cpu") == "fp32 on cpu" and kernels(True, "cpu") == "bf16 on cpu"
    assert kernels(False, "cuda") == "fp32 trainer, bf16 engines on cuda"  # vLLM's GPU attention wants 16 bits
    assert SyncGuard(device="cuda").ceiling == CEILING["bf16"]


def test_the_flag_overrides_and_the_calibration_is_only_said(caplog):
    guard = SyncGuard(flag=0.1, bf16=True)
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        assert guard.check(0.042, step=1, staleness=0, version=0)
    assert guard.threshold == 0.1
    assert said(caplog) == [
        "sync guard: healthy engine gap 0.042 per token at step 1 (this model, bf16 on cpu); stopping past 0.1 "
        "(--max_engine_logprob_gap; calibrated: 0.17)"
    ]
    with pytest.raises(EngineMismatchError, match=r"past --max_engine_logprob_gap 0.1 \(bf16 on cpu\)"):
        guard.check(0.11, step=2, staleness=0, version=1)
    assert SyncGuard(flag=1.0).check(0.5, step=1, staleness=0, version=0)  # no ceiling when the user set the bar
    with pytest.raises(EngineMismatchError):
        SyncGuard(flag=1e-3).check(2e-3, step=1, staleness=0, version=0)
    off = SyncGuard(flag=0.0)
    assert off.check(10.0, step=1, staleness=0, version=0) is False and off.healthy is None
    assert SyncGuard(flag=-1.0).check(10.0, step=1, staleness=0) is False


def test_from_flags():
    cfg = build_config({"max_engine_logprob_gap": 0.01, "bf16": True}, explicit={"max_engine_logprob_gap", "bf16"})
    guard = SyncGuard.from_config(resolve_device(cfg, "cpu"))
    assert guard.threshold == 0.01 and guard.bf16 and guard.device == "cpu"
    calibrating = SyncGuard.from_config(resolve_device(build_config({}, explicit=set()), "cuda"))
    assert calibrating.flag is None and calibrating.threshold is None and calibrating.device == "cuda"


def test_a_first_check_after_a_sync_is_not_calibrated_on(caplog):
    """Rollouts of weight version 1 came from synced engines: a broken sync would be taken for healthy."""
    guard = SyncGuard()
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        assert guard.check(5e-4, step=3, staleness=0, version=1)
    assert guard.healthy is None and guard.threshold == CEILING["fp32"]
    (line,) = said(caplog)
    assert "no healthy engine gap of this run to calibrate on" in line and "version 1" in line
    assert "stopping past 0.001" in line


def test_a_checkpoint_keeps_the_calibration(caplog):
    first = SyncGuard(bf16=True)
    first.check(6.2e-4, step=1, staleness=0, version=0)
    state = first.state_dict()
    assert state == {"healthy": 6.2e-4, "threshold": pytest.approx(2.58e-3), "kernels": "bf16 on cpu"}
    resumed = SyncGuard(bf16=True)
    caplog.clear()  # the first guard's calibration line, where a logger above is at INFO already
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        resumed.load_state_dict(state)
    assert said(caplog) == [
        "sync guard: stopping past 0.0026 per token, as calibrated at the start of this run (healthy engine gap "
        "0.00062, bf16 on cpu)"
    ]
    # the resumed first step follows a sync: judged, not calibrated on (a broken sync stays broken)
    with pytest.raises(EngineMismatchError, match="calibrated on this run's healthy gap 0.00062"):
        resumed.check(5.9e-3, step=7, staleness=0, version=6)
    assert resumed.threshold == first.threshold


def test_a_checkpoint_without_a_calibration_for_these_kernels_gives_the_ceiling(caplog):
    state = SyncGuard(bf16=True).state_dict()
    assert state is None  # saved before the first check
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        guard = SyncGuard(bf16=True)
        guard.load_state_dict(None)
        assert guard.threshold == CEILING["bf16"]
        cpu = SyncGuard()
        cpu.check(2e-7, step=1, staleness=0, version=0)
        on_gpu = SyncGuard(device="cuda")
        on_gpu.load_state_dict(cpu.state_dict())  # --device is free on resume; the kernels are not the same
        assert on_gpu.threshold == CEILING["bf16"]
    lines = said(caplog)
    assert "the checkpoint holds none" in lines[0]
    assert "the checkpoint's calibration was made with fp32 on cpu" in lines[-1]
    assert "fp32 trainer, bf16 engines on cuda" in lines[-1]


def test_no_judgement_where_the_gap_is_not_a_sync_fault():
    # Async rollouts from older weights differ by the policy's own update, not by a broken sync.
    guard = SyncGuard(async_train=True)
    assert guard.check(0.5, step=3, staleness=1, version=1) is False and guard.healthy is None
    # At --temperature 0.7 the engines report processed (after-temperature) log-probs, as the actor: judged.
    with pytest.raises(EngineMismatchError):
        SyncGuard(temperature=0.7).check(0.5, step=1, staleness=0)
    # ... unless top-p truncates them too: the actor scores the full distribution.
    assert SyncGuard(temperature=0.7, top_p=0.9).check(0.5, step=1, staleness=0) is False
    assert SyncGuard(top_p=0.9).check(2e-4, step=1, staleness=0) is True  # raw at temperature 1


def test_without_async_samples_of_an_older_version_are_a_missed_sync():
    """Without --async_train every step samples from the weights of the update just before it: an older version
    means a sync did not reach an engine. Stopped whatever the gap, so in bf16 too, where one update can be smaller
    than the rounding, and whatever the temperature and top-p; not with the guard off."""
    for guard in (SyncGuard(), SyncGuard(bf16=True), SyncGuard(temperature=0.7, top_p=0.9)):
        with pytest.raises(EngineMismatchError, match=r"^step 3: its samples came from weight version 1, 1 update"):
            guard.check(1e-7, step=3, staleness=1, version=1)
    assert SyncGuard(flag=0.0).check(1e-7, step=3, staleness=1, version=1) is False


def _announced(caplog, **kw) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orlhf.trainer.sync_guard"):
        SyncGuard(**kw).announce()
    return said(caplog)


def test_where_the_guard_does_not_look_is_said_at_the_start(caplog):
    (off,) = _announced(caplog, temperature=0.7, top_p=0.9)
    assert "not checked in this run" in off and "--temperature 0.7" in off and "--top_p 0.9" in off
    (stale,) = _announced(caplog, async_train=True)
    assert "--async_train" in stale and "staleness 0" in stale
    assert _announced(caplog, temperature=0.7) == [] and _announced(caplog) == []
    assert _announced(caplog, flag=0.0, temperature=0.7, top_p=0.9) == []  # off: nothing to say


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
    guard = SyncGuard()
    guard.check(2e-7, step=1, staleness=0, version=0)
    with pytest.raises(EngineMismatchError):
        guard.check(float("nan"), step=2, staleness=0, version=1)
    with pytest.raises(EngineMismatchError):  # nor is a NaN calibrated on
        SyncGuard().check(float("nan"), step=1, staleness=0, version=0)


def test_the_controllers_checkpoint_carries_the_calibration(tmp_path):
    """save_run writes it with the controller's state, restore_run gives it back (trainer/run_state.py)."""
    from orlhf.trainer.run_state import restore_run
    from tests.unit.test_controller_saves import make

    ctl, _ = make(tmp_path / "a")
    ctl.guard.check(1.5e-5, step=1, staleness=0, version=0)
    ctl.step_index = 1
    path = ctl.save_checkpoint()
    resumed, _ = make(tmp_path / "b")
    resumed.loader.load_state_dict = lambda state: None
    restore_run(resumed.run_state(), path)
    assert resumed.guard.settled and resumed.guard.healthy == 1.5e-5
    assert resumed.guard.threshold == ctl.guard.threshold == pytest.approx(1.6e-4)
