"""The sync guard inside the loop: a step whose engine log-probs are far from the actor's stops the run before the
actor trains on them (or, on a single pass, before the update reaches the engines), and the CLI turns the error
into exit 1 with the message; step 1 calibrates the threshold, a checkpoint keeps it. Stand-ins for the rank groups
and engines (the loop's call order is pure logic; the guard's statistic on real engines is
tests/vllm/test_sync_guard_breaks.py)."""

import pytest
import torch

from orlhf.cli import run_reporting_errors
from orlhf.config.flags import build_config
from orlhf.inputs.rewards import RewardResult
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from orlhf.types import Rollout, TrainStats
from tests.unit.rollout_stand_in import StandInRollout

ENGINE_LP, ACTOR_LP = -1.0, -1.5  # per token: a gap of 0.5, the size of a sync that missed the head


class Done:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value

    def get_cat(self):
        return self.value


class Actor:
    """Answers the loop's calls; records their names. Its log-probs are ACTOR_LP on every token; `trained`: the
    TrainStats fields its train steps report (a diverged update's NaN loss), in the order of its steps."""

    world_size = 1

    def __init__(self, log, trained=()):
        self.log, self.trained = log, list(trained)

    def call_sharded(self, method, batch, *args):
        self.log.append(method.__name__)
        if method.__name__ == "log_probs":
            return Done(torch.full(batch.action_mask.shape, ACTOR_LP))
        # train_step on a single pass: the actor measured the gap in its training forward (sum, token count)
        tokens = float(batch.action_mask.sum())
        stats = {"loss": 0.0, "grad_norm": 0.5, "entropy": 1.0, **(self.trained.pop(0) if self.trained else {})}
        return Done(
            [
                TrainStats(
                    lr=0.0,
                    extra={"engine_gap_sum": abs(ENGINE_LP - ACTOR_LP) * tokens, "engine_gap_tokens": tokens},
                    **stats,
                )
            ]
        )


class Engines:
    def generate(self, prompt_ids, sampling):
        return [
            Rollout(prompt_index=i, prompt_ids=ids, response_ids=[5, 6, 7], logprobs=[ENGINE_LP] * 3, finished=True)
            for i, ids in enumerate(prompt_ids)
            for _ in range(sampling.n)
        ]


class Rewards:
    def evaluate(self, queries, prompts, labels):
        return RewardResult.of(torch.zeros(len(queries)))


class Tokenizer:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x" * len(i) for i in ids]


class Prompt:
    def __init__(self, i):
        self.ids, self.text, self.label = [1, 2 + i], f"q{i}", None


class Loader:
    total_steps = 2

    def __iter__(self):
        return iter([[Prompt(0), Prompt(1)], [Prompt(2), Prompt(3)]])


def make(tmp_path, trained=(), generate=None, **flags):
    cfg = build_config({"save_path": str(tmp_path), **flags}, set(flags))
    log = []
    models = Models(actor=Actor(log, trained), ref=None, rollout=StandInRollout(generate or Engines().generate, log))
    ctl = Controller(cfg, models, Loader(), Tokenizer(), metrics=None, reward_source=Rewards())
    return cfg, ctl, log


def rollouts(prompt_ids, sampling, gap: float, version: int) -> list[Rollout]:
    """Three sampled tokens per sample whose engine log-probs sit `gap` from the actor's, tagged with `version`."""
    return [
        Rollout(i, ids, [5, 6, 7], [ACTOR_LP + gap] * 3, finished=True, weight_version=version)
        for i, ids in enumerate(prompt_ids)
        for _ in range(sampling.n)
    ]


def two_step_run(tmp_path, generate=None, **flags):
    """A reinforce run with a reference (its old log-probs come from their own forward, before training) whose
    engines sample with `generate` (default: the stand-in engines); its metrics go nowhere."""
    cfg, ctl, log = make(
        tmp_path,
        generate=generate,
        rollout_batch_size=2,
        train_batch_size=2,
        micro_train_batch_size=1,
        init_kl_coef=0.01,
        advantage_estimator="reinforce",
        **flags,
    )
    ctl.metrics = type("M", (), {"log": lambda *a: None})()
    return cfg, ctl, log


def test_engines_that_disagree_before_any_sync_stop_the_run_at_step_1(tmp_path, capsys):
    cfg, ctl, log = make(
        tmp_path, rollout_batch_size=2, train_batch_size=2, micro_train_batch_size=1, init_kl_coef=0.01
    )
    assert not cfg.single_pass  # the old log-probs come from their own forward, before training

    def train(_cfg):
        ctl.fit()
        return 0

    assert run_reporting_errors(train, cfg) == 1
    assert log == ["log_probs"]  # stopped after scoring: no train_step, no sync
    err = capsys.readouterr().err
    assert "error: step 1:" in err and "differ from the actor's by 0.5" in err
    assert "before any weight sync" in err and "past 0.001, the most a healthy engine" in err
    assert "Traceback" not in err


def test_step_1_calibrates_and_a_broken_sync_stops_the_next_step(tmp_path, capsys, caplog):
    """Step 1's engines hold the folder's weights, as the actor: their gap is the healthy one. After the sync the gap
    jumps (a tied head left at step 0, an engine behind): step 2 stops before training, naming the calibration."""
    steps = iter(enumerate([2.4e-7, 0.05]))  # per token, on log-probs of -1.5 in float32

    def generate(prompt_ids, sampling):
        version, gap = next(steps)  # engines tag rollouts with the weight version they hold: 0, then 1
        return rollouts(prompt_ids, sampling, gap, version)

    cfg, ctl, log = two_step_run(tmp_path, generate)
    with caplog.at_level("INFO", logger="orlhf.trainer.sync_guard"):
        assert run_reporting_errors(lambda _: ctl.fit(), cfg) == 1
    assert log == ["log_probs", "train_step", "sync", "log_probs"]  # step 2 never trains
    assert [r.getMessage() for r in caplog.records if r.name == "orlhf.trainer.sync_guard"] == [
        "sync guard: healthy engine gap 2.4e-07 per token at step 1 (this model, fp32 on cpu); stopping past 0.0001"
    ]
    err = capsys.readouterr().err
    assert "error: step 2:" in err and "by 0.05 per token" in err
    assert "past the sync guard's threshold 0.0001, calibrated on this run's healthy gap 2.4e-07" in err
    assert ctl.guard.state_dict()["healthy"] == pytest.approx(2.4e-7, rel=0.01)  # what a checkpoint keeps


def test_a_sync_that_never_reached_the_engines_stops_the_next_step_whatever_the_gap(tmp_path, capsys):
    """The engines keep sampling with version 0 after step 1's sync (it did not reach them) and their gap stays at
    rounding level (an update smaller than bf16's rounding looks so): step 2 stops before training, on the version."""

    cfg, ctl, log = two_step_run(tmp_path, lambda prompt_ids, sampling: rollouts(prompt_ids, sampling, 2.4e-7, 0))
    ctl.m.rollout.load_weights = lambda version: log.append("sync") or 0.0  # the version never moves
    assert run_reporting_errors(lambda _: ctl.fit(), cfg) == 1
    assert log == ["log_probs", "train_step", "sync", "log_probs"]  # step 2 never trains
    err = capsys.readouterr().err
    assert "error: step 2: its samples came from weight version 0, 1 update(s) behind the actor's (1)" in err
    assert "a weight sync did not reach an engine" in err


def test_single_pass_stops_before_the_update_reaches_the_engines(tmp_path):
    import pytest

    from orlhf.trainer.sync_guard import EngineMismatchError

    cfg, ctl, log = make(
        tmp_path,
        rollout_batch_size=2,
        train_batch_size=2,
        micro_train_batch_size=1,
        init_kl_coef=0.0,
        advantage_estimator="reinforce",
    )
    assert cfg.single_pass  # the actor's training forward measures the gap
    with pytest.raises(EngineMismatchError, match="by 0.5 per token"):
        ctl.fit()
    assert log == ["train_step"]  # the engines never get weights trained on the mismatched samples


def test_a_healthy_gap_trains_and_syncs(tmp_path):
    cfg, ctl, log = two_step_run(tmp_path, max_engine_logprob_gap=0.6)
    ctl.fit()
    assert log == ["log_probs", "train_step", "sync"] * 2
    assert [round(r["engine_logprob_gap"], 6) for r in ctl.history] == [0.5, 0.5]


def test_a_nan_loss_stops_the_run_before_the_update_reaches_the_engines(tmp_path, capsys):
    """A diverged update (--actor_learning_rate 1e30 on the demo) trained on with NaN losses, logged null, and
    exported its weights; now the step that trains to a NaN stops the run with one line, before the sync."""
    cfg, ctl, log = make(
        tmp_path,
        trained=[{}, {"loss": float("nan"), "entropy": float("nan"), "grad_norm": 0.0}],
        rollout_batch_size=2,
        train_batch_size=2,
        micro_train_batch_size=1,
        init_kl_coef=0.0,
        advantage_estimator="reinforce",
        max_engine_logprob_gap=0.6,
        actor_learning_rate=1e30,
    )
    ctl.metrics = type("M", (), {"log": lambda *a: None})()

    def train(_cfg):
        ctl.fit()
        return 0

    assert run_reporting_errors(train, cfg) == 1
    assert log == ["train_step", "sync", "train_step"]  # step 2's NaN weights never reach the engines
    assert len(ctl.history) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert err == (
        "error: step 2: policy_loss nan, entropy nan in training: the updates diverged, so the run stops before these "
        "weights reach the engines, a checkpoint or the export. Train again with a lower --actor_learning_rate "
        "(now 1e+30)."
    )


def test_non_finite_log_probs_stop_before_training(tmp_path):
    import pytest

    from orlhf.trainer.step_stats import NonFiniteError

    global ACTOR_LP
    _, ctl, log = make(tmp_path, rollout_batch_size=2, train_batch_size=2, micro_train_batch_size=1, init_kl_coef=0.01)
    saved, ACTOR_LP = ACTOR_LP, float("nan")
    try:
        with pytest.raises(NonFiniteError, match=r"step 1: engine_logprob_gap nan before training \(the actor's"):
            ctl.fit()
    finally:
        ACTOR_LP = saved
    assert log == ["log_probs"]


def test_a_run_whose_updates_stalled_twice_stops_with_exit_1(tmp_path, capsys):
    """--actor_learning_rate 1e3 on the demo: from step 2 on the gradient norm is exactly 0 under a loss that is not
    (the saturated policy learns nothing more); the run warned, trained on and exported with exit 0. Now the second
    stalled step in a row stops it, before its sync, with exit 1. A step of zero advantages (loss 0) is no stall; one
    stalled step alone is not one (a last mini-batch may have had nothing to learn)."""
    stalled = {"grad_norm": 0.0, "loss": -2.8e-7}
    cfg, ctl, log = make(
        tmp_path,
        trained=[stalled, {"grad_norm": 0.0, "loss": 0.0}, stalled, stalled, stalled],
        rollout_batch_size=2,
        train_batch_size=2,
        micro_train_batch_size=1,
        init_kl_coef=0.0,
        advantage_estimator="reinforce",
        max_engine_logprob_gap=0.6,
    )
    ctl.loader = type("L", (), {"total_steps": 5, "__iter__": lambda self: iter([[Prompt(0), Prompt(1)]] * 5)})()
    ctl.metrics = type("M", (), {"log": lambda *a: None})()
    assert run_reporting_errors(lambda _: ctl.fit(), cfg) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: step 4: the actor's gradient norm is exactly 0 while its loss is not (-2.8e-07), as on the step "
        "before: its updates vanish (or overflow and are skipped), so the policy collapsed and learns nothing more; "
        "the run stops here, before these weights reach the engines, a checkpoint or the export. The updates were "
        "too large: train again with a lower --actor_learning_rate (now 0.0005)."
    )
    assert log == ["train_step", "sync"] * 3 + ["train_step"]  # step 4 trained, never synced
