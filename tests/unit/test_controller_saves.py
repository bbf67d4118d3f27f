"""The controller's checkpoint call order, with recording stand-ins for the rank groups (pure call-order logic:
the real groups are exercised by tests/e2e/test_resume.py): DeepSpeed's save_checkpoint and save_hf are both
collectives on the actor ranks, so they must never be in flight together; --stop_after_steps saves at the stop."""

from orlhf.config.flags import build_config
from orlhf.storage.checkpoint import CheckpointManager
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from tests.unit.rollout_stand_in import StandInRollout


class Call:
    def __init__(self, group, method):
        self.group, self.method = group, method

    def get(self):
        self.group.in_flight.remove(self.method)


class RecordingGroup:
    """Records which methods are in flight on its ranks whenever one starts."""

    def __init__(self, name, log, world_size=1):
        self.name, self.log, self.world_size, self.in_flight = name, log, world_size, []

    def call(self, method, path):
        method = method.__name__  # a method reference (orlhf/distributed/endpoints.py)
        self.log.append((self.name, method, tuple(self.in_flight)))
        self.in_flight.append(method)
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "rng_rank0.json").write_text("{}")
        return Call(self, method)


class Loader:
    steps_per_episode, total_steps = 10, 10

    def state_dict(self):
        return {"episode": 0, "batch_in_episode": 0}

    def __iter__(self):
        return iter([["prompt"]] * self.total_steps)


def make(tmp_path, **flags):
    cfg = build_config({"save_path": str(tmp_path), "save_hf_ckpt": True, **flags}, {"save_hf_ckpt", *flags})
    log = []
    models = Models(
        actor=RecordingGroup("actor", log), critic=RecordingGroup("critic", log), ref=None, rollout=StandInRollout()
    )
    ctl = Controller(
        cfg,
        models,
        Loader(),
        tokenizer=None,
        metrics=None,
        checkpoints=CheckpointManager(tmp_path / "ck", 3, run_id="r"),
    )
    return ctl, log


def test_save_hf_starts_only_after_the_deepspeed_saves_finished(tmp_path):
    ctl, log = make(tmp_path)
    ctl.step_index = 4
    ctl.save_checkpoint()
    assert [(g, m) for g, m, _ in log] == [
        ("actor", "save_checkpoint"),
        ("critic", "save_checkpoint"),
        ("actor", "save_hf"),
    ]
    assert log[-1][2] == ()  # nothing else in flight on the actor ranks when save_hf started
    assert (tmp_path / "ck" / "step_000004" / "meta.json").exists()


def test_stop_saves_once_at_the_stop_step(tmp_path):
    ctl, log = make(tmp_path, stop_after_steps=3)
    ctl.step_index = 3
    assert ctl.should_stop()
    ctl.save_at_stop()
    ctl.save_at_stop()  # already saved at this step: no second save
    assert [m for _, m, _ in log].count("save_hf") == 1
    assert [p.name for p in (tmp_path / "ck").glob("step_*")] == ["step_000003"]


class Metrics:
    def __init__(self):
        self.steps = []

    def log(self, step, row):
        self.steps.append(step)


class Filter:
    """Stands in for DynamicFilter (its batches are tested in test_shaping.py): one full batch per fill."""

    def fill(self, batches, step_index):
        return Filled()


class Filled:
    prompts, rollouts, reward, info = [], [], None, {}


def test_dynamic_filtering_saves_at_the_stop(tmp_path):
    """--dynamic_filtering runs its own loop (Controller.fit_filtered): --stop_after_steps must save there too."""
    ctl, log = make(tmp_path, stop_after_steps=2, dynamic_filtering=True, n_samples_per_prompt=2)
    ctl.metrics, ctl.filter = Metrics(), Filter()

    def learn(prompts, rollouts, reward=None):  # the step itself is not under test: only the loop around it
        ctl.step_index += 1
        return {"reward_mean": 0.0, "kl": 0.0, "samples_per_s": 1.0}

    ctl.learn = learn
    ctl.fit()
    assert ctl.step_index == 2 and ctl.metrics.steps == [1, 2]
    assert [p.name for p in (tmp_path / "ck").glob("step_*")] == ["step_000002"]


def test_the_best_eval_checkpoint_records_the_run_id(tmp_path):
    """launch/run.py builds the best-eval manager from the rotation's (CheckpointManager.best): same run id, also the
    one a resume took over from its checkpoint, into <ckpt_path>/best, one kept."""
    import json

    ctl, _ = make(tmp_path)
    ctl.checkpoints.run_id = "resumed0001"  # as launch.run_inputs.resume_point sets it before the controller is built
    ctl.best_checkpoints = ctl.checkpoints.best()
    for step in (2, 4):
        ctl.step_index = step
        ctl.save_checkpoint(ctl.best_checkpoints)
    (saved,) = (tmp_path / "ck" / "best").glob("step_*")
    assert saved.name == "step_000004"
    assert json.loads((saved / "meta.json").read_text())["run_id"] == "resumed0001"
    assert ctl._saved_step is None  # the best copy is not the rotation's save of the step
