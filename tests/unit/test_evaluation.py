"""Eval metrics on hand-written scores, and when evaluations are due / improved."""

import torch

from orlhf.trainer.evaluation import Evaluator, eval_metrics, metric_name


def test_metrics_of_binary_scores():
    # 3 prompts x 2 samples: [1, 0] [0, 0] [1, 1]
    m = eval_metrics(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), n=2, response_lengths=[2, 4, 6, 8, 10, 12])
    assert m["eval/reward_mean"] == 0.5
    assert m["eval/pass@1"] == 0.5  # 3 of 6 samples
    assert abs(m["eval/pass@2"] - 2 / 3) < 1e-7  # prompts 0 and 2 have a passing sample
    assert m["eval/response_length"] == 7.0


def test_partial_scores_count_in_the_mean_not_in_pass():
    m = eval_metrics(torch.tensor([0.5, 0.9]), n=1)
    assert abs(m["eval/reward_mean"] - 0.7) < 1e-6 and m["eval/pass@1"] == 0.0 and "eval/response_length" not in m


def test_metric_names():
    assert metric_name("pass@k", 4) == "eval/pass@4"
    assert metric_name("pass@1", 4) == "eval/pass@1" and metric_name("eval/reward_mean", 4) == "eval/reward_mean"


def test_due_every_n_steps_and_after_the_last():
    ev = Evaluator([], 2, 0.6, 1.0, 8, 42, every=3)
    assert [s for s in range(1, 9) if ev.due(s, last=s == 8)] == [3, 6, 8]
    never = Evaluator([], 2, 0.6, 1.0, 8, 42, every=-1)
    assert [s for s in range(1, 9) if never.due(s, last=s == 8)] == [8]


def test_best_is_strictly_better():
    ev = Evaluator([], 4, 0.6, 1.0, 8, 42, every=1, best_metric_key="pass@k")
    seen = [ev.improved({"eval/pass@4": v}) for v in (0.2, 0.1, 0.2, 0.5)]
    assert seen == [True, False, False, True] and ev.best == 0.5
    assert not Evaluator([], 4, 0.6, 1.0, 8, 42, every=1).improved({"eval/pass@4": 1.0})  # no key: no best


def test_run_scores_rollouts_with_fixed_seeds():
    from orlhf.types import Rollout

    specs = []

    def generate(prompts, spec):
        specs.append(spec)
        return [Rollout(i // spec.n, [1], [2, 3], [0.0, 0.0], True) for i in range(len(prompts) * spec.n)]

    ev = Evaluator(["p", "q"], 2, 0.6, 1.0, 8, 42, every=1)
    m1 = ev.run(1, generate, lambda rollouts, prompts: torch.tensor([1.0, 0.0, 0.0, 0.0]))
    ev.run(2, generate, lambda rollouts, prompts: torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert m1["eval/pass@2"] == 0.5 and m1["eval/response_length"] == 2.0
    assert specs[0] == specs[1] and specs[0].temperature == 0.6 and specs[0].n == 2
