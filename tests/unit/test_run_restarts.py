"""launch/restart.py: which failures restart the run, how many, and where the next attempt resumes (pure logic, with
stand-in groups; tests/e2e/test_faults.py kills a real rank)."""

import json
import logging

import pytest

from orlhf.cli import main
from orlhf.distributed.groups import RankError
from orlhf.launch.restart import Attempt, RunRestarts, gone_processes
from orlhf.rollout.backend import EngineProcesses
from orlhf.storage.checkpoint import CheckpointManager


class Group:
    def __init__(self, role, dead=(), actors=("a",), host_role=None):
        self.role, self._dead, self.actors, self.host_role = role, dead, list(actors), host_role

    def dead(self, timeout_s):
        return {r: RuntimeError("gone") for r in self._dead}


@EngineProcesses.register  # declares the health check of backends with engines of their own
class Engines:
    """A rollout backend's health check (EngineProcesses.dead): the engines found dead."""

    def __init__(self, dead=()):
        self._dead = dead

    def dead(self, timeout_s):
        return {i: RuntimeError("gone") for i in self._dead}


class Models:
    def __init__(self, groups, rollout=None):
        self._groups, self.rollout = groups, rollout

    def groups(self):
        return self._groups


class Ctl:
    def __init__(self, step_index, history, saving=False):
        self.step_index, self.history, self.saving = step_index, history, saving


def test_a_dead_process_is_named_once_and_a_live_failure_is_not_a_loss():
    actor = Group("actor", dead=[1], actors=("x", "y"))
    guest = Group("ref", dead=[1], actors=actor.actors, host_role="actor")  # the CPU guest: the same processes
    attempt = Attempt(models=Models([actor, guest], Engines(dead=[0])))
    died = RankError("ref", 1, "log_probs", "the rank actor died", died=True, host="actor")
    assert gone_processes(died, attempt) == ["actor rank 1", "vllm engine 0"]
    healthy = Attempt(models=Models([Group("actor")], Engines()))
    assert gone_processes(ValueError("a bug"), healthy) == []
    assert gone_processes(RankError("actor", 0, "train", "Traceback: a bug"), healthy) == []
    starting = Attempt(rollout=Engines(dead=[1]))  # during the start-up: the engines launched so far
    assert gone_processes(TimeoutError("init"), starting) == ["vllm engine 1"]


def test_restarts_are_bounded_and_each_says_what_was_lost(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="orlhf")
    restarts = RunRestarts(1, str(tmp_path), "run-a")
    lost = Attempt(models=Models([Group("actor", dead=[0])]), controller=Ctl(3, []), phase="training")
    assert restarts.may_restart(RuntimeError("gloo: connection closed"), lost)
    assert (
        "actor rank 0 lost during step 4 (found dead after: gloo: connection closed); restarting the run's groups "
        "(restart 1 of --max_restarts 1)" in caplog.text
    )
    assert not restarts.may_restart(RuntimeError("again"), lost)
    assert "actor rank 0 lost during step 4; not restarted: --max_restarts 1, 1 used" in caplog.text
    died = RankError("critic", 0, "values", "the rank actor died", died=True, host="actor")
    assert RunRestarts(1, str(tmp_path), "run-a").may_restart(died, lost)
    assert "actor rank 0 lost during step 4 (its process died in critic values()); restarting" in caplog.text
    hung = RankError("actor", 0, "train", "no answer to a health check for 60 s (--hang_timeout_s): hung", hung=True)
    assert gone_processes(hung, Attempt(models=Models([Group("actor")]))) == ["actor rank 0"]  # a hung one is gone
    assert RunRestarts(1, str(tmp_path), "run-a").may_restart(hung, lost)
    assert "actor rank 0 lost during step 4 (its process stopped answering health checks in actor train()); " in (
        caplog.text
    )
    # noticed while step 3's checkpoint was written (the step after 3 has not begun), or in the export
    saving = Attempt(models=lost.models, controller=Ctl(3, [], saving=True), phase="training")
    assert RunRestarts(1, str(tmp_path), "run-a").may_restart(RuntimeError("x"), saving)
    assert "actor rank 0 lost during the checkpoint of step 3 (found dead after: x)" in caplog.text
    exporting = Attempt(models=lost.models, controller=Ctl(6, []), phase="export")
    assert RunRestarts(1, str(tmp_path), "run-a").may_restart(RuntimeError("x"), exporting)
    assert "actor rank 0 lost during the export (found dead after: x)" in caplog.text
    assert not RunRestarts(0, str(tmp_path), "run-a").may_restart(RuntimeError("x"), lost)
    assert "not restarted: --max_restarts 0" in caplog.text


def _save(mgr: CheckpointManager, step: int) -> None:
    tmp = mgr.begin(step)
    (tmp / "state.txt").write_text("x")
    mgr.commit(tmp, step, {"fingerprint": {}})


def test_the_next_attempt_resumes_this_runs_newest_checkpoint_or_the_start(tmp_path):
    ckpt = tmp_path / "ckpt"
    _save(CheckpointManager(ckpt, 5, "other-run"), 6)  # another run's, in the same folder: never taken
    mine = CheckpointManager(ckpt, 5, "run-a")
    restarts = RunRestarts(2, str(tmp_path), "run-a")
    rows = [{"step": s} for s in range(1, 6)]
    lost = Attempt(models=Models([Group("actor", dead=[0])]), controller=Ctl(5, rows), phase="training")
    assert restarts.may_restart(RuntimeError("x"), lost)
    fresh = restarts.next_attempt(lost, mine)
    assert (fresh.resume_from, fresh.resume_step, fresh.number, fresh.carried) == (None, 0, 1, [])

    _save(mine, 2)
    _save(mine, 4)
    resumed = Attempt(None, None, 0, 0, carried=[], controller=Ctl(5, rows), models=lost.models, phase="training")
    assert restarts.may_restart(RuntimeError("x"), resumed)
    nxt = restarts.next_attempt(resumed, mine)
    assert nxt.resume_from.name == "step_000004" and nxt.resume_step == 4 and nxt.number == 2
    assert nxt.carried == rows[:4]  # the summary keeps steps 1-4; 5 is trained again
    records = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["lost"], r["step"], r["at"], r["restart"]) for r in records] == [
        (["actor rank 0"], 6, 0, 1),
        (["actor rank 0"], 6, 4, 2),
    ]
    assert records[1]["resumed_from"].endswith("step_000004")
    RunRestarts(2, str(tmp_path), "run-b")  # a fresh run starts a fresh record
    assert not (tmp_path / "restarts.jsonl").exists()


@pytest.mark.parametrize("value, code", [("-1", 2), ("0", 0)])
def test_a_negative_restart_count_exits_2_naming_the_flag(value, code, capsys, no_training):
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--max_restarts", value])
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    if code:
        assert "--max_restarts must be >= 0 (got -1" in err and "Traceback" not in err
    else:
        assert no_training[0].runtime.max_restarts == 0
