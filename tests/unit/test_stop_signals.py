"""SIGTERM / SIGINT at each phase of a run (orlhf/launch/stop_signals.py): a step ends and is saved, a checkpoint or
the export is finished, within --stop_grace_s; the start-up and a restart stop at once, a second signal (or two
arriving as one) stops at once, one signal is never two, a signal never raises into the main thread (an import in
progress included), and the last line says where, what is kept and how to continue. Real signals to this process;
the loop and its saves run with stand-ins for the rank groups (pure call-order logic), and "stop now" calls a
recorder instead of ending the run's processes and this one (tests/e2e/test_stop_sweep.py stops real runs)."""

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orlhf.config.flags import build_config
from orlhf.launch import stop_signals
from orlhf.launch.restart import Attempt
from orlhf.launch.stop_signals import RESTART, RunStop
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
            os.kill(os.getpid(), sig)  # in the middle of the step, which goes on until the stop thread has read it
            deadline = time.monotonic() + 10
            while ctl.stop_signal is None and time.monotonic() < deadline:
                time.sleep(0.01)
        ctl.step_index += 1
        return {"reward_mean": 0.0, "kl": 0.0, "samples_per_s": 1.0}

    ctl.learn = learn
    return ctl


class Ended:
    """What "stop now" did: the exit code it ended with (the processes' end is a no-op here)."""

    def __init__(self):
        self.codes: list[int] = []
        self.done = threading.Event()

    def exit(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()

    @staticmethod
    def kill(wait_s: float) -> None:  # never this test process's children
        return None


@pytest.fixture
def ended():
    return Ended()


def install(ended: Ended, grace_s: float = 15.0):
    return RunStop.installed(grace_s, exit=ended.exit, kill=ended.kill)


def until(condition, timeout: float = 10.0) -> None:
    """Wait for what the stop thread does on an arrival (it reads the wakeup pipe beside this thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the stop thread did not act"
        time.sleep(0.01)


def training(stop: RunStop, ctl) -> Attempt:
    attempt = Attempt(controller=ctl, phase="training")
    stop.follow(attempt)
    stop.checkpoints = ctl.checkpoints
    return attempt


def warnings(caplog) -> list[str]:
    """orlhf's own warnings: a Ray cluster an earlier test of the session left up forwards its processes' lines
    (the autoscaler's status) to this process's logging meanwhile."""
    ours = [r for r in caplog.records if r.name == "orlhf" or r.name.startswith("orlhf.")]
    return [r.getMessage() for r in ours if r.levelno == logging.WARNING]


def test_sigterm_ends_the_step_saves_it_and_says_how_to_resume(tmp_path, caplog, ended):
    ctl = make(tmp_path, signal_at_step=3)
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO), install(ended) as stop:
        training(stop, ctl)
        ctl.fit()
        assert stop.outcome(0) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # put back after the run
    assert ctl.step_index == 3 and ctl.checkpoints.latest().name == "step_000003"
    assert not ended.codes  # the main thread ended the run, as after any run
    assert warnings(caplog) == [
        "SIGTERM during step 3: stopping after it, with a checkpoint there, if that takes at most 15 s "
        "(--stop_grace_s); SIGTERM again stops at once, without one",
        f"stopped by SIGTERM during step 3: checkpoint {tmp_path / 'ck' / 'step_000003'} kept; run the same command "
        "with --load_checkpoint to continue from it",
    ]


def test_a_second_signal_stops_at_once_and_says_what_the_newest_checkpoint_is(tmp_path, caplog, ended):
    ctl = make(tmp_path, signal_at_step=3, sig=signal.SIGINT)
    ctl.step_index = 1
    ctl.save_checkpoint()
    ctl.step_index = 0

    def second():  # while step 3 is being saved: the stop ends the run before the save's end
        os.kill(os.getpid(), signal.SIGINT)
        until(ended.done.is_set)

    ctl.m.actor.on_save = second
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl)
        ctl.fit()
        assert stop.outcome(None) == 130 and ended.codes == [130]
    assert warnings(caplog) == [
        "SIGINT during step 3: stopping after it, with a checkpoint there, if that takes at most 15 s "
        "(--stop_grace_s); Ctrl-C again stops at once, without one",
        "stopped at once by a second SIGINT during the checkpoint of step 3: the newest checkpoint is "
        f"{tmp_path / 'ck' / 'step_000001'}; run the same command with --load_checkpoint to continue from it (the "
        "steps after it are trained again)",
    ]


def test_two_signals_that_reach_the_handler_as_one_call_count_as_two(tmp_path, caplog, ended):
    """Python runs a handler once for the signals that arrived while the main thread waited in C code (here: a
    thread's join; in a run, Ray's waits): two Ctrl-C 0.5 s apart once counted as one. The stop thread reads one byte
    per arrival from the wakeup pipe."""
    ctl = make(tmp_path)

    def press_twice():  # both delivered to this thread, whose C handler writes one byte each
        me = threading.get_ident()
        signal.pthread_kill(me, signal.SIGINT)
        signal.pthread_kill(me, signal.SIGINT)

    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl)
        presser = threading.Thread(target=press_twice)
        presser.start()
        presser.join()
        until(ended.done.is_set)
        assert ended.codes == [130]
    assert warnings(caplog)[-1] == (
        "stopped at once by a second SIGINT during step 1: no checkpoint kept: run the same command to start again "
        "from the beginning"
    )


def test_one_signal_is_one_wherever_the_main_thread_waits(tmp_path, caplog, ended):
    """One SIGINT to the process, sent while the main thread sleeps in C code, then a long wait: the step is let
    finish (never "a second SIGINT"), whatever number of handler calls or bytes the wait collects."""
    ctl = make(tmp_path)
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        time.sleep(0.3)
        until(lambda: ctl.stop_signal == "SIGINT")
        time.sleep(0.3)
        assert not ended.codes and not stop.forced
    assert [w.split(":")[0] for w in warnings(caplog)] == ["SIGINT during step 1"]


def test_the_start_up_and_a_restart_stop_at_once(tmp_path, caplog, ended):
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # before any attempt: Ray starting, inputs being read
        until(ended.done.is_set)
        assert ended.codes == [143] and stop.outcome(None) == 143
    assert warnings(caplog) == [
        "stopped by SIGTERM during the start-up: no checkpoint kept: run the same command to start again from the "
        "beginning"
    ]

    caplog.clear()
    ctl = make(tmp_path / "b")
    ctl.step_index = 4
    ctl.save_checkpoint()
    ctl.step_index = 5  # a rank died in step 6
    ended = Ended()
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl)
        stop.phase = RESTART  # the lost attempt being torn down (launch/run.py)
        os.kill(os.getpid(), signal.SIGINT)
        until(ended.done.is_set)
        assert ended.codes == [130]
    assert warnings(caplog) == [
        "stopped by SIGINT during the restart after a lost process: the newest checkpoint is "
        f"{tmp_path / 'b' / 'ck' / 'step_000004'}; run the same command with --load_checkpoint to continue from it "
        "(the steps after it are trained again)"
    ]
    with install(Ended()) as stop:  # the next attempt's start-up is the restart's too
        stop.follow(Attempt(number=1))
        assert stop.describe() == "during the restart after a lost process"


def test_a_signal_never_raises_into_an_import(tmp_path, ended, monkeypatch):
    """A handler that raised once landed inside an import on the main thread: the module lock left held hung the
    inputs thread's `import torch`, and the driver's join of it, for good. Now a signal in the middle of an import
    (here: a module that signals this process as it is imported, beside a thread importing the same module) lets both
    imports finish; the stop itself comes from the stop thread."""
    (tmp_path / "slow_module_for_stop_test.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.3)\nDONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    other: list = []
    with install(ended):
        t = threading.Thread(target=lambda: other.append(__import__("slow_module_for_stop_test").DONE))
        t.start()  # it imports the module too, or waits on its lock while this thread runs it
        import slow_module_for_stop_test  # noqa: F401 - the signal arrives while one of the imports runs

        t.join(timeout=10)
        until(ended.done.is_set)
    assert slow_module_for_stop_test.DONE and other == [True] and ended.codes == [143]


def test_a_step_that_outlasts_the_grace_stops_with_the_newest_checkpoint(tmp_path, caplog, ended):
    ctl = make(tmp_path)
    ctl.step_index = 2
    ctl.save_checkpoint()

    def long_step(prompts, rollouts):  # a generation that goes on past the grace
        os.kill(os.getpid(), signal.SIGTERM)
        until(ended.done.is_set)
        ctl.step_index += 1
        return {"reward_mean": 0.0, "kl": 0.0, "samples_per_s": 1.0}

    ctl.learn = long_step
    with caplog.at_level(logging.WARNING), install(ended, grace_s=0.2) as stop:
        training(stop, ctl)
        ctl.fit()
        assert ended.codes == [143]
    assert warnings(caplog)[-1] == (
        "stopped by SIGTERM during step 3 (it did not end within --stop_grace_s 0.2 s): checkpoint "
        f"{tmp_path / 'ck' / 'step_000002'} kept; run the same command with --load_checkpoint to continue from it"
    )


def test_a_teardown_that_outlasts_its_bound_is_ended(tmp_path, caplog, ended, monkeypatch):
    """A signal while a complete run tears down is said and waited for, within END_S; past it the run's processes
    and the driver are ended (a teardown waiting on a dead cluster once took 60 s)."""
    monkeypatch.setattr(stop_signals, "END_S", 0.2)
    ctl = make(tmp_path)
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl).phase = "done"
        os.kill(os.getpid(), signal.SIGTERM)
        until(ended.done.is_set)
        assert ended.codes == [143]
    assert warnings(caplog)[0] == "SIGTERM: the run is ending; its processes are being shut down"
    assert warnings(caplog)[-1].startswith("stopped by SIGTERM at the end of the run: ")


def test_a_complete_runs_teardown_cut_short_still_ends_as_complete(tmp_path, caplog, ended):
    """The export written, a second signal during the teardown: the run stops at once and exits 0, saying the run is
    complete (not "start again from the beginning")."""
    ctl = make(tmp_path)
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        attempt = training(stop, ctl)
        attempt.phase = "export"
        os.kill(os.getpid(), signal.SIGINT)
        until(lambda: ctl.stop_signal is not None)
        attempt.complete, attempt.phase = True, "done"
        os.kill(os.getpid(), signal.SIGINT)
        until(ended.done.is_set)
        assert ended.codes == [0]
    assert warnings(caplog)[-1] == "SIGINT at the end of the run: the run is complete, only its teardown was cut short"


def test_the_export_is_finished_first_and_the_run_ends_as_a_finished_one(tmp_path, caplog, ended):
    ctl = make(tmp_path)
    ctl.step_index = 10
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        attempt = training(stop, ctl)
        attempt.phase = "export"
        os.kill(os.getpid(), signal.SIGTERM)
        until(lambda: ctl.stop_signal == "SIGTERM")  # finish_run skips the figures
        attempt.phase = "done"
        assert stop.outcome(0) == 0
    assert warnings(caplog) == [
        "SIGTERM during the export: stopping once it is written, if that takes at most 15 s (--stop_grace_s); "
        "SIGTERM again stops at once, without it",
        "SIGTERM during the export: it finished first, so the run is complete; nothing to continue",
    ]
    caplog.clear()
    ctl.save_checkpoint()
    ended = Ended()
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl).phase = "export"
        os.kill(os.getpid(), signal.SIGTERM)
        until(lambda: ctl.stop_signal is not None)
        os.kill(os.getpid(), signal.SIGTERM)
        until(ended.done.is_set)
        assert ended.codes == [143]
    assert warnings(caplog)[-1] == (
        "stopped at once by a second SIGTERM during the export: the export was not written; checkpoint "
        f"{tmp_path / 'ck' / 'step_000010'} kept; run the same command with --load_checkpoint to continue from it"
    )


def test_nothing_is_saved_before_the_first_step_nor_among_another_runs_checkpoints(tmp_path, caplog, ended):
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
    with caplog.at_level(logging.WARNING), install(ended) as stop:
        training(stop, ctl)
        stop.signal, stop.where = "SIGTERM", "during step 2"
        assert stop.outcome(0) == 143
    assert warnings(caplog)[-1] == (
        "stopped by SIGTERM during step 2: no checkpoint kept: run the same command to start again from the beginning"
    )


def test_an_ignored_sigint_stays_ignored(ended):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's
    try:
        with install(ended):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_nothing_is_installed(ended):
    """Python sets signal handlers in the main thread only: a run started from another thread keeps its defaults."""
    seen = []

    def run():
        with install(ended) as stop:
            seen.append((stop._previous, signal.getsignal(signal.SIGTERM)))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == [({}, signal.getsignal(signal.SIGTERM))]


def test_a_signal_after_the_runs_line_ends_the_process_with_the_lines_code(tmp_path):
    """The command keeps its handlers to its last instant (entry.py, exit_keeping_handlers): a second signal that
    comes after the run's line (the first let a checkpoint finish, the run ended, the process is exiting) ends it
    with the line's code, never by the signal's default action (rc -15); the exit functions still run and the
    output is flushed as Python's exit would. A real process: the exit path is the point."""
    import subprocess
    import sys

    script = tmp_path / "ends.py"
    marker = tmp_path / "exit_functions_ran"
    script.write_text(
        "import atexit, os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from orlhf.launch.stop_signals import RunStop, exit_keeping_handlers\n"
        "def late():\n"
        f"    Path({str(marker)!r}).write_text('yes')\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "atexit.register(late)\n"
        "with RunStop.installed(until_exit=True) as stop:\n"
        "    code = stop.outcome(3)\n"
        "sys.stdout.write('unflushed tail')\n"
        "exit_keeping_handlers(code)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=120)
    assert done.returncode == 3, done.stderr.decode()[-2000:]
    assert marker.read_text() == "yes"
    assert done.stdout.decode().endswith("unflushed tail")
