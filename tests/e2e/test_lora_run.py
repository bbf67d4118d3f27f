"""`orlhf train-ppo --lora_rank` end to end on the built-in demo: real Ray, DeepSpeed, vLLM.

GRPO with a KL loss learns (the e2e criterion: last 10 steps' mean reward >= 1.5 x the first 10's) with the
   sync guard on (its default threshold), no reference group placed (the actor's adapter-off forward scores the
   reference), the engines' log-probs within 1e-5 of the trainer's at every step; the export is the adapter in
   PEFT's format and, with --lora_save_merged, the merged model, and both give the same log-probs.
   The demo's model is random, so its task (say color words) lives in the output head: the run adapts the head
   (--target_modules ... lm_head, an untied head) besides the decoder's Linear layers; all-linear alone learns it
   slowly.
A LoRA actor's resume (the adapter and its optimizer state from a checkpoint, the next step bit-equal) is shown at
the worker level, tests/workers/test_lora_mp.py; the controller's side of a resume, tests/e2e/test_resume.py.
"""

import json
from pathlib import Path

import pytest
import torch

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
LORA = ["--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "q_proj", "k_proj", "v_proj", "o_proj"]
LORA += ["gate_proj", "up_proj", "down_proj", "lm_head", "--actor_learning_rate", "5e-3"]
GRPO = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--use_kl_loss"]


def run(save: Path, *flags: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--device", "cpu", "--save_path", str(save), *LORA, *GRPO, *flags])
    return exit_.value.code


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_lora_grpo_learns_with_the_guard_and_exports_the_adapter(ray_local, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    save = tmp_path / "run"
    # 24 steps of 32 prompts x 4 samples: the criterion's 10 + 10 steps, at half the demo's batch
    short = ["--max_samples", "256", "--rollout_batch_size", "32", "--train_batch_size", "64"]
    assert run(save, *short, "--num_episodes", "3", "--lora_save_merged") == 0
    got = rows(save)
    rewards = [r["reward_mean"] for r in got]
    assert sum(rewards[-10:]) >= 1.5 * sum(rewards[:10]), [round(x, 3) for x in rewards]
    assert max(r["engine_logprob_gap"] for r in got) < 1e-5  # the engines sample the adapted policy
    assert all(r["kl"] > 0 for r in got[1:])  # the KL against the base (adapter off) is real
    driver = (save / "logs" / "driver.log").read_text()
    assert "ref: " not in driver and "no reference group" in driver
    actor, merged = save / "actor", save / "actor_merged"
    assert (actor / "adapter_config.json").exists() and not (actor / "model.safetensors").exists()
    base = json.loads((actor / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), actor).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    ids = torch.randint(4, 900, (4, 16), generator=torch.Generator().manual_seed(0))
    assert (log_probs(adapted, ids) - log_probs(plain, ids)).abs().max().item() < 1e-5
