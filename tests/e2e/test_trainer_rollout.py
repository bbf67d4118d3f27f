"""`orlhf train-ppo --vllm_num_engines 0` (--rollout_backend trainer) end to end on the built-in demo: real Ray and
DeepSpeed, no vLLM engine; the actor's ranks generate (workers/generation.py, rollout/actor_rollout.py).

1. GRPO on the demo, DAPO-style (clip-higher, dynamic filtering, soft overlong penalty) with GSPO's sequence-level
   ratio, learns: last 10 steps' mean generated reward >= 1.5 x the first 10's, the sampler's log-probs within 1e-5
   of the training forward's at every step (the sync guard on), no engine started, the export loads in
   transformers. (The algorithm's checks ride on this run: they do not depend on which backend generates.)
2. Multi-turn agents on two ZeRO-3 actor ranks (the whole model gathered for generate, the batch split over the
   ranks, agents' turns batched through one client): a run stopped after 2 steps and resumed equals an
   uninterrupted one, metric for metric and weight for weight.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import orlhf
from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
DEMO_AGENT = str(Path(orlhf.__file__).parent / "demo" / "agent.py")


def run(save: Path, *flags: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--device", "cpu", "--save_path", str(save), "--vllm_num_engines", "0", *flags])
    return exit_.value.code


def rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


def test_the_demo_learns_with_the_actor_generating_dapo_style(ray_local, tmp_path):
    from transformers import AutoModelForCausalLM

    save = tmp_path / "run"
    # up to 24 steps of 32 prompts x 4 samples (dynamic filtering's refills read more prompts a step), at half the
    # demo's batch; DAPO's recipe with GSPO's sequence-level ratio: clip-higher, dynamic filtering, the soft
    # overlong penalty
    grpo = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--actor_learning_rate", "2e-3"]
    short = ["--max_samples", "256", "--rollout_batch_size", "32", "--train_batch_size", "64", "--num_episodes", "3"]
    dapo = ["--policy_loss_type", "gspo", "--eps_clip_low_high", "0.2", "0.28", "--dynamic_filtering"]
    dapo += ["--overlong_buffer_len", "4", "--overlong_penalty_factor", "0.1"]
    assert run(save, *grpo, *short, *dapo) == 0
    got = rows(save)
    assert len(got) >= 20, len(got)
    assert "value_loss" not in got[0]  # group_norm: no critic
    keys = {"dynamic_filtering_pass_rate", "clip_frac_low", "clip_frac_high", "entropy", "overlong_penalized_share"}
    assert keys <= set(got[0]), set(got[0])
    assert all(0 < r["dynamic_filtering_pass_rate"] <= 100 for r in got)
    # reward_mean is over the kept samples, which filtering biases; the policy's own reward is over all generated.
    rewards = [r["reward_generated_mean"] for r in got]
    assert sum(rewards[-10:]) >= 1.5 * sum(rewards[:10]), [round(x, 3) for x in rewards]
    assert max(r["engine_logprob_gap"] for r in got) < 1e-5  # sampled from exactly the policy that trains
    assert [r["weight_version"] for r in got] == list(range(1, len(got) + 1))
    driver = (save / "logs" / "driver.log").read_text()
    assert "rollouts: generated in the actor's ranks" in driver and "vllm engines:" not in driver
    assert not list((save / "logs").glob("vllm-*.log"))
    model = AutoModelForCausalLM.from_pretrained(save / "actor")
    assert model.config.vocab_size > 0


def test_agents_on_two_zero3_ranks_resume_as_an_uninterrupted_run(ray_local, tmp_path):
    flags = ["--max_samples", "128", "--num_episodes", "2", "--rollout_batch_size", "64"]  # 2 steps an episode
    flags += ["--agent_func_path", DEMO_AGENT, "--generate_max_len", "8", "--zero_stage", "3"]
    flags += ["--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2"]
    flags += ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--use_kl_loss"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(a, *flags) == 0
    assert run(b, *flags, "--stop_after_steps", "2") == 0
    assert run(b, *flags, "--load_checkpoint") == 0
    full, resumed = rows(a), rows(b)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert all(r["agent/turns"] == 3.0 for r in full)
    for ra, rb in zip(full, resumed):
        for key in ("reward_mean", "kl", "policy_loss", "response_length", "entropy", "engine_logprob_gap"):
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])
    wa, wb = load_file(a / "actor" / "model.safetensors"), load_file(b / "actor" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
