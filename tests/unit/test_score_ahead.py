"""Async mode starts the frozen models' forwards (reference, reward model) as soon as a batch is generated
(Scorer.ahead in orlhf/trainer/scoring.py), while the trainers still work on the batch before; learn() then takes
those results instead of calling again. Stand-ins for the groups and engines: what is checked is the loop's call
order and that the step's result is the same either way (the real async run: tests/e2e/test_agent.py,
tests/e2e/test_train_ppo.py)."""

import threading
import time

import torch

from orlhf.config.flags import build_config
from orlhf.inputs.rewards import RewardResult
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from orlhf.types import Rollout, TrainStats
from tests.unit.rollout_stand_in import StandInRollout
from tests.unit.test_controller_guard import Done  # a finished call's stand-in

FLAGS = dict(
    rollout_batch_size=2,
    train_batch_size=4,
    micro_train_batch_size=2,
    n_samples_per_prompt=2,
    advantage_estimator="group_norm",
    use_kl_loss=True,
    init_kl_coef=0.01,
    max_engine_logprob_gap=0,
)


class Group:
    """A rank group answering log_probs (from the tokens: a different value per position) and train_step; every
    call is logged as (method, the batch's smallest first response token, thread name, time)."""

    world_size = 1

    def __init__(self, log, train_s=0.0):
        self.log, self.train_s = log, train_s

    def call_sharded(self, method, batch, *args):
        first = int(batch.sequences[:, -batch.num_actions].min())  # names the batch, in any row order
        self.log.append((method.__name__, first, threading.current_thread().name, time.perf_counter()))
        if method.__name__ == "log_probs":
            return Done(-0.01 * batch.sequences[:, -batch.num_actions :].float())
        time.sleep(self.train_s)
        self.log.append(("train_step_end", first, threading.current_thread().name, time.perf_counter()))
        loss = float(batch.advantages.abs().sum() + batch.base_action_log_probs.sum())  # reads the ref log-probs
        tokens = float(batch.action_mask.sum())  # on a single pass the actor measures the engine gap
        extra = {"engine_gap_sum": 0.0, "engine_gap_tokens": tokens}
        return Done([TrainStats(loss=loss, lr=0.0, grad_norm=1.0, extra=extra)])  # an update that moves weights


class Engines:
    """Rollouts whose tokens depend on the batch (prompt ids) and the sample, so every batch differs; each call
    takes gen_s."""

    gen_s = 0.0

    def generate(self, prompt_ids, sampling):
        time.sleep(self.gen_s)
        return [
            Rollout(
                prompt_index=i,
                prompt_ids=ids,
                response_ids=[ids[-1] + 10, ids[-1] + 11 + j, 7 + j],
                logprobs=[-0.01 * (ids[-1] + 10), -0.01 * (ids[-1] + 11 + j), -0.01 * (7 + j)],
                finished=True,
            )
            for i, ids in enumerate(prompt_ids)
            for j in range(sampling.n)
        ]


class Rewards:
    def evaluate(self, queries, prompts, labels):
        return RewardResult.of(torch.tensor([float(len(q) % 3) for q in queries]))


class Tokenizer:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x" * sum(i) for i in ids]


class Prompt:
    def __init__(self, i):
        self.ids, self.text, self.label = [1, 20 * (i + 1)], f"q{i}", None


class Loader:
    total_steps = 3

    def __iter__(self):
        return iter([[Prompt(2 * k), Prompt(2 * k + 1)] for k in range(self.total_steps)])


class Metrics:
    def log(self, *a):
        pass


def make(tmp_path, train_s=0.0, gen_s=0.0, **flags):
    flags = {**FLAGS, **flags}
    cfg = build_config({"save_path": str(tmp_path), **flags}, set(flags))
    log = []
    engines = Engines()
    engines.gen_s = gen_s
    models = Models(actor=Group(log, train_s), ref=Group(log), rollout=StandInRollout(engines.generate))
    return Controller(cfg, models, Loader(), Tokenizer(), Metrics(), reward_source=Rewards()), log


def same_result(row):
    return {k: v for k, v in row.items() if not k.startswith("timing/") and k not in ("samples_per_s", "step_s")}


def test_a_step_scored_ahead_equals_the_step_scored_in_learn(tmp_path):
    plain, plain_log = make(tmp_path / "a")
    early, early_log = make(tmp_path / "b")
    for prompts in Loader():
        rollouts = plain.generate(prompts, plain.step_index)
        row = plain.learn(prompts, rollouts)
        ahead = early.scorer.ahead(prompts, rollouts)
        assert [c[0] for c in early_log[-1:]] == ["log_probs"]  # the reference started before learn()
        row_ahead = early.learn(prompts, rollouts, ahead=ahead)
        assert same_result(row_ahead) == same_result(row)
    # the same calls, once each: the reference's log-probs and the train step per batch
    assert [c[:2] for c in early_log] == [c[:2] for c in plain_log]
    assert [c[0] for c in plain_log] == ["log_probs", "train_step", "train_step_end"] * 3


def test_async_starts_the_next_reference_forward_while_the_actor_trains(tmp_path):
    ctl, log = make(tmp_path, train_s=0.4, gen_s=0.1, async_train=True)
    ctl.fit()
    assert len(ctl.history) == 3
    refs = [c for c in log if c[0] == "log_probs"]
    assert len(refs) == 3 and all(c[2] == "orlhf-rollout-producer" for c in refs)  # never again in learn()
    trains = [c for c in log if c[0] == "train_step"]
    ends = [c for c in log if c[0] == "train_step_end"]
    assert [c[1] for c in refs] == [c[1] for c in trains]  # one per batch, in loader order
    # batch 2's reference forward was started while batch 1 trained (before its train step ended)
    assert trains[0][3] < refs[1][3] < ends[0][3]
