"""SIGTERM / SIGINT at each phase of a run (orlhf/launch/stop_signals.py): a step ends and is saved, a checkpoint or
the export is finished, the start-up and a restart stop at once, a second signal (or two arriving as one) stops at
once, and the last line says where, what is kept and how to continue. Real signals to this process; the loop and its
saves run with stand-ins for the rank groups (pure call-order logic; tests/e2e/test_faults.py signals a real run)."""

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from orlhf.config.flags import build_config
from orlhf.launch.restart import Attempt
from orlhf.launch.stop_signals import RESTART, RunStop, RunStopped
from orlhf.storage.checkpoint import CheckpointManager
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from tests.unit.rollout_stand_in import StandInRollout


@pytest.fixture(autouse=True)
def sigint_as_from_a_terminal():
    """Each test starts with SIGINT handled as in a process started from a terminal. A suite started in the background
    (`cmd &` in a script, nohup) inherits SIGINT as ignored, and RunStop then rightly leaves it ignored
    (test_an_ignored_sigint_stays_ignored), so the Ctrl-C cases would test nothing."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


class Done:
    def get(self):
        return None


class Group:
    world_size = 1

    def __init__(self):
        self.on_save = lambda: None  # what happens while a checkpoint is written (a signal, in a test)

    def call(self, method, path):
        self.on_save()
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "rng_rank0.json").write_text("{}")
        return Done()


class Loader:
    steps_per_episode, total_steps = 10, 10

    def state_dict(self):
        return {"episode": 0, "batch_in_episode": 0}

    def __iter__(self):
        return iter([["prompt"]] * self.total_steps)


def make(tmp_path, signal_at_step=None, run_id="r", sig=signal.SIGTERM):
    """A controller whose steps only count; `signal_at_step`: `sig` to this process during that step."""
    cfg = build_config({"save_path": str(tmp_path)}, set())
    models = Models(actor=Group(), critic=None, ref=None, rollout=StandInRollout())
    ctl = Controller(
        cfg, models, Loader(), tokenizer=None, metrics=None, checkpoints=CheckpointManager(tmp_path / "ck", 3, run_id)
    )
    ctl.generate = lambda prompts, index: []
    ctl.metrics = SimpleNamespace(log=lambda *a: None)

    def learn(prompts, rollouts):
        if ctl.step_index + 1 == signal_at_step:
            os.kill(os.getpid(), sig)  # the handler runs here, in the middle of the step
        ctl.step_index += 1
        return {"reward_mean": 0.0, "kl": 0.0, "samples_per_s": 1.0}

    ctl.learn = learn
    return ctl


def training(stop: RunStop, ctl) -> Attempt:
    attempt = Attempt(controller=ctl, phase="training")
    stop.follow(attempt)
    stop.checkpoints = ctl.checkpoints
    return attempt


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_sigterm_ends_the_step_saves_it_and_says_how_to_resume(tmp_path, caplog):
    ctl = make(tmp_path, signal_at_step=3)
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO), RunStop.installed() as stop:
        training(stop, ctl)
        ctl.fit()
        assert stop.outcome(0) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # put back after the run
    assert ctl.step_index == 3 and ctl.checkpoints.latest().name == "step_000003"
    assert warnings(caplog) == [
        "SIGTERM during step 3: stopping after it, with a checkpoint there; SIGTERM again stops at once, without one",
        f"stopped by SIGTERM during step 3: checkpoint {tmp_path / 'ck' / 'step_000003'} kept; run the same command "
        "with --load_checkpoint to continue from it",
    ]


def test_a_second_signal_stops_at_once_and_says_what_the_newest_checkpoint_is(tmp_path, caplog):
    ctl = make(tmp_path, signal_at_step=3, sig=signal.SIGINT)
    ctl.step_index = 1
    ctl.save_checkpoint()
    ctl.step_index = 0
    ctl.m.actor.on_save = lambda: os.kill(os.getpid(), signal.SIGINT)  # the second, while step 3 is being saved
    with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
        training(stop, ctl)
        with pytest.raises(RunStopped):
            ctl.fit()
        assert stop.outcome(None) == 130
    assert ctl.checkpoints.latest().name == "step_000001"  # step 3's was not written
    assert warnings(caplog) == [
        "SIGINT during step 3: stopping after it, with a checkpoint there; Ctrl-C again stops at once, without one",
        "stopped at once by a second SIGINT during the checkpoint of step 3: the newest checkpoint is "
        f"{tmp_path / 'ck' / 'step_000001'}; run the same command with --load_checkpoint to continue from it (the "
        "steps after it are trained again)",
    ]


def test_two_signals_that_reach_the_handler_as_one_call_stop_at_once(tmp_path, caplog):
    """Python runs a handler once for the signals that arrived while the main thread waited in C code (here: a
    thread's join; in a run, Ray's waits): two Ctrl-C 0.5 s apart counted as one. The wakeup pipe counts them."""
    ctl = make(tmp_path)

    def press_twice():  # both delivered to this thread, whose C handler trips Python's flag twice
        me = threading.get_ident()
        signal.pthread_kill(me, signal.SIGINT)
        signal.pthread_kill(me, signal.SIGINT)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60)  # the presser keeps the interpreter between its two signals
    try:
        with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
            training(stop, ctl)
            presser = threading.Thread(target=press_twice)
            with pytest.raises(RunStopped):
                presser.start()
                presser.join()
                [None for _ in range(10)]  # bytecode: the handler runs by now
            presser.join()
            assert stop.outcome(None) == 130
    finally:
        sys.setswitchinterval(interval)
    assert warnings(caplog) == [
        "stopped at once by a second SIGINT during step 1: no checkpoint kept: run the same command to start again "
        "from the beginning"
    ]


def test_the_start_up_and_a_restart_stop_at_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
        with pytest.raises(RunStopped):
            os.kill(os.getpid(), signal.SIGTERM)  # before any attempt: Ray starting, inputs being read
        os.kill(os.getpid(), signal.SIGTERM)  # tearing down now: said, nothing raised
        assert stop.outcome(None) == 143
    assert warnings(caplog) == [
        "SIGTERM: the run is ending; its processes are being shut down",
        "stopped by SIGTERM during the start-up: no checkpoint kept: run the same command to start again from the "
        "beginning",
    ]

    caplog.clear()
    ctl = make(tmp_path / "b")
    ctl.step_index = 4
    ctl.save_checkpoint()
    ctl.step_index = 5  # a rank died in step 6
    with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
        training(stop, ctl)
        stop.phase = RESTART  # the lost attempt being torn down (launch/run.py)
        with pytest.raises(RunStopped):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.outcome(None) == 130
    assert warnings(caplog) == [
        "stopped by SIGINT during the restart after a lost process: the newest checkpoint is "
        f"{tmp_path / 'b' / 'ck' / 'step_000004'}; run the same command with --load_checkpoint to continue from it "
        "(the steps after it are trained again)"
    ]
    with RunStop.installed() as stop:  # the next attempt's start-up is the restart's too
        stop.follow(Attempt(number=1))
        assert stop.describe() == "during the restart after a lost process"


def test_the_export_is_finished_first_and_the_run_ends_as_a_finished_one(tmp_path, caplog):
    ctl = make(tmp_path)
    ctl.step_index = 10
    with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
        attempt = training(stop, ctl)
        attempt.phase = "export"
        os.kill(os.getpid(), signal.SIGTERM)
        assert ctl.stop_signal == "SIGTERM"  # finish_run skips the figures
        attempt.phase = "done"
        assert stop.outcome(0) == 0
    assert warnings(caplog) == [
        "SIGTERM during the export: stopping once it is written; SIGTERM again stops at once, without it",
        "SIGTERM during the export: it finished first, so the run is complete; nothing to continue",
    ]
    caplog.clear()
    ctl.save_checkpoint()
    with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
        training(stop, ctl).phase = "export"
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(RunStopped):
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.outcome(None) == 143
    assert warnings(caplog)[-1] == (
        "stopped at once by a second SIGTERM during the export: the export was not written; checkpoint "
        f"{tmp_path / 'ck' / 'step_000010'} kept; run the same command with --load_checkpoint to continue from it"
    )


def test_nothing_is_saved_before_the_first_step_nor_among_another_runs_checkpoints(tmp_path, caplog):
    ctl = make(tmp_path, signal_at_step=1)
    ctl.learn = lambda prompts, rollouts: pytest.fail("trained after the signal")
    ctl.stop_signal = "SIGTERM"  # arrived before the first step
    ctl.fit()
    assert ctl.checkpoints.latest() is None

    other = make(tmp_path, run_id="another")  # a run without --save_steps was not refused this --ckpt_path
    other.step_index = 7
    other.save_checkpoint()
    ctl.step_index = 2
    with caplog.at_level(logging.WARNING):
        ctl.save_at_stop()
    assert ctl.checkpoints.latest().name == "step_000007"  # nothing of this run among the other run's
    assert "holds another run's checkpoint" in caplog.records[-1].getMessage()
    with caplog.at_level(logging.WARNING), RunStop.installed() as stop:
        training(stop, ctl)
        stop.signal, stop.where = "SIGTERM", "during step 3"
        assert stop.outcome(0) == 143
    assert warnings(caplog)[-1] == (
        "stopped by SIGTERM during step 3: no checkpoint kept: run the same command to start again from the beginning"
    )


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's
    try:
        with RunStop.installed():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_nothing_is_installed():
    """Python sets signal handlers in the main thread only: a run started from another thread keeps its defaults."""
    seen = []

    def run():
        with RunStop.installed() as stop:
            seen.append((stop._previous, signal.getsignal(signal.SIGTERM)))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == [({}, signal.getsignal(signal.SIGTERM))]
