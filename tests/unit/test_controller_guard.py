"""The sync guard inside the loop: a step whose engine log-probs are far from the actor's stops the run before the
actor trains on them (or, on a single pass, before the update reaches the engines), and the CLI turns the error
into exit 1 with the message. Stand-ins for the rank groups and engines (the loop's call order is pure logic; the
guard's statistic on real engines is tests/vllm/test_model_families.py)."""

import torch

from orlhf.cli import run_reporting_errors
from orlhf.config.flags import build_config
from orlhf.inputs.rewards import RewardResult
from orlhf.trainer.controller import Controller, Models
from orlhf.types import Rollout, TrainStats

ENGINE_LP, ACTOR_LP = -1.0, -1.5  # per token: a gap of 0.5, the size of a sync that missed the head


class Done:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value

    def get_cat(self):
        return self.value


class Actor:
    """Answers the loop's calls; records their names. Its log-probs are ACTOR_LP on every token."""

    world_size = 1

    def __init__(self, log):
        self.log = log

    def call_sharded(self, method, batch, *args):
        self.log.append(method.__name__)
        if method.__name__ == "log_probs":
            return Done(torch.full(batch.action_mask.shape, ACTOR_LP))
        # train_step on a single pass: the actor measured the gap in its training forward (sum, token count)
        tokens = float(batch.action_mask.sum())
        return Done(
            [
                TrainStats(
                    loss=0.0,
                    lr=0.0,
                    extra={"engine_gap_sum": abs(ENGINE_LP - ACTOR_LP) * tokens, "engine_gap_tokens": tokens},
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


class Sync:
    def __init__(self, log):
        self.log = log

    def sync(self, version):
        self.log.append("sync")


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


def make(tmp_path, **flags):
    cfg = build_config({"save_path": str(tmp_path), **flags}, set(flags))
    log = []
    models = Models(actor=Actor(log), ref=None, engines=Engines(), sync=Sync(log))
    ctl = Controller(cfg, models, Loader(), Tokenizer(), metrics=None, reward_source=Rewards())
    return cfg, ctl, log


def test_the_run_stops_before_training_on_another_policys_samples(tmp_path, capsys):
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
    assert "--max_engine_logprob_gap 0.001 (fp32)" in err and "tied lm_head" in err
    assert "Traceback" not in err


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
    cfg, ctl, log = make(
        tmp_path,
        rollout_batch_size=2,
        train_batch_size=2,
        micro_train_batch_size=1,
        init_kl_coef=0.01,
        max_engine_logprob_gap=0.6,
        advantage_estimator="reinforce",
    )
    ctl.metrics = type("M", (), {"log": lambda *a: None})()
    ctl.fit()
    assert log == ["log_probs", "train_step", "sync"] * 2
    assert [round(r["engine_logprob_gap"], 6) for r in ctl.history] == [0.5, 0.5]
