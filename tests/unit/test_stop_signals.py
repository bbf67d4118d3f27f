"""SIGTERM / SIGINT while training (orlhf/launch/stop_signals.py): the step in progress ends, a checkpoint is saved
there, and one line says what was kept and how to resume; a second signal stops at once. The loop and its saves run
with stand-ins for the rank groups (pure call-order logic; tests/e2e/test_faults.py signals a real run)."""

import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from orlhf.config.flags import build_config
from orlhf.launch.stop_signals import report_stop, stop_on_signals
from orlhf.storage.checkpoint import CheckpointManager
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from tests.unit.rollout_stand_in import StandInRollout


class Done:
    def get(self):
        return None


class Group:
    world_size = 1

    def call(self, method, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "rng_rank0.json").write_text("{}")
        return Done()


class Loader:
    steps_per_episode, total_steps = 10, 10

    def state_dict(self):
        return {"episode": 0, "batch_in_episode": 0}

    def __iter__(self):
        return iter([["prompt"]] * self.total_steps)


def make(tmp_path, signal_at_step=None, run_id="r"):
    """A controller whose steps only count; `signal_at_step`: SIGTERM to this process during that step."""
    cfg = build_config({"save_path": str(tmp_path)}, set())
    models = Models(actor=Group(), critic=None, ref=None, rollout=StandInRollout())
    ctl = Controller(
        cfg, models, Loader(), tokenizer=None, metrics=None, checkpoints=CheckpointManager(tmp_path / "ck", 3, run_id)
    )
    ctl.generate = lambda prompts, index: []
    ctl.metrics = SimpleNamespace(log=lambda *a: None)

    def learn(prompts, rollouts):
        if ctl.step_index + 1 == signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the middle of the step
        ctl.step_index += 1
        return {"reward_mean": 0.0, "kl": 0.0, "samples_per_s": 1.0}

    ctl.learn = learn
    return ctl


def test_sigterm_ends_the_step_saves_it_and_says_how_to_resume(tmp_path, caplog):
    ctl = make(tmp_path, signal_at_step=3)
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO), stop_on_signals(ctl):
        ctl.fit()
    assert signal.getsignal(signal.SIGTERM) is before  # put back after the loop
    assert ctl.step_index == 3 and ctl.checkpoints.latest().name == "step_000003"
    assert report_stop(ctl) == 128 + signal.SIGTERM
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        "SIGTERM: stopping after step 3 (the one in progress) with a checkpoint there; SIGTERM again stops at once, "
        "without one",
        f"interrupted by SIGTERM after step 3: checkpoint {tmp_path / 'ck' / 'step_000003'} kept; run the same "
        "command with --load_checkpoint to continue from it",
    ]


def test_a_second_signal_stops_at_once(tmp_path):
    ctl = SimpleNamespace(stop_signal=None, step_index=0)
    with pytest.raises(KeyboardInterrupt), stop_on_signals(ctl):
        os.kill(os.getpid(), signal.SIGINT)
        assert ctl.stop_signal == "SIGINT"
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nothing_is_saved_before_the_first_step_nor_among_another_runs_checkpoints(tmp_path, caplog):
    ctl = make(tmp_path, signal_at_step=1)
    ctl.learn = lambda prompts, rollouts: pytest.fail("trained after the signal")
    ctl.stop_signal = "SIGTERM"  # arrived before the first step
    ctl.fit()
    assert ctl.checkpoints.latest() is None
    with caplog.at_level(logging.WARNING):
        assert report_stop(ctl) == 143
    assert caplog.records[-1].getMessage().endswith("no checkpoint kept: a new run starts from the beginning")

    other = make(tmp_path, run_id="another")  # a run without --save_steps was not refused this --ckpt_path
    other.step_index = 7
    other.save_checkpoint()
    ctl.step_index = 2
    with caplog.at_level(logging.WARNING):
        ctl.save_at_stop()
    assert ctl.checkpoints.latest().name == "step_000007"  # nothing of this run among the other run's
    assert "holds another run's checkpoint" in caplog.records[-1].getMessage()
