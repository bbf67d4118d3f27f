"""`orlhf train-ppo` with an OpenRLHF-format reward model and a two-source prompt mix: real Ray, DeepSpeed, vLLM.

The reward model is the demo's backbone shape with OpenRLHF's old head name "value_head.weight" and, in its
config.json, mean 1000 / std 1: with --normalize_reward every score is (r - 1000) / 1, so a logged reward near
-1000 proves the stored statistics reached the reward worker (a tiny random head scores |r| < 10), and the run
itself proves the head was found (a missing head stops the run).
"""

import json
from pathlib import Path

import pytest

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]


def openrlhf_reward_model(folder: Path, mean: float) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, LlamaModel

    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    config = AutoConfig.from_pretrained(demo.model)
    torch.manual_seed(0)
    backbone = LlamaModel(config)
    sd = {f"model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    sd["value_head.weight"] = torch.randn(1, config.hidden_size) / config.hidden_size**0.5
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**config.to_dict(), "architectures": ["RewardModel"], "normalize_reward": True, "mean": mean, "std": 1.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    AutoTokenizer.from_pretrained(demo.model).save_pretrained(folder)
    return folder


def run(tmp_path: Path, *flags: str) -> int:
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    rows = [json.loads(line) for line in open(demo.prompts)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in rows[:100]))
    b.write_text("".join(json.dumps(r) + "\n" for r in rows[100:200]))
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "train-ppo",
                "--save_path",
                str(tmp_path / "run"),
                "--device",
                "cpu",
                "--pretrain",
                str(demo.model),
                "--prompt_data",
                f"{a},{b}",
                "--prompt_data_probs",
                "0.7,0.3",
                "--input_key",
                "prompt",
                "--max_samples",
                "128",
                "--rollout_batch_size",
                "64",
                "--train_batch_size",
                "64",
                "--micro_train_batch_size",
                "16",
                "--micro_rollout_batch_size",
                "32",
                "--prompt_max_len",
                "64",
                "--generate_max_len",
                "16",
                "--enforce_eager",
                *flags,
            ]
        )
    return exit_.value.code


def test_openrlhf_reward_model_with_stored_statistics_and_a_prompt_mix(ray_local, tmp_path):
    rm = openrlhf_reward_model(tmp_path / "rm", mean=1000.0)
    code = run(
        tmp_path,
        "--reward_pretrain",
        str(rm),
        "--value_head_prefix",
        "value_head",
        "--normalize_reward",
        "--advantage_estimator",
        "gae",
    )  # the critic starts from the reward model's head
    assert code == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 2
    assert all(-1010 < r["reward_mean"] < -990 for r in rows), [r["reward_mean"] for r in rows]


def test_wrong_prefix_stops_before_any_model_starts_naming_the_tensors(tmp_path, capsys):
    rm = openrlhf_reward_model(tmp_path / "rm", mean=0.0)
    assert run(tmp_path, "--reward_pretrain", str(rm), "--advantage_estimator", "reinforce") == 1
    err = capsys.readouterr().err
    assert f"{rm}: no value head 'score.weight' for --value_head_prefix score" in err, err
    assert "value_head.weight [1, 128]" in err and "Pass --value_head_prefix value_head" in err, err
