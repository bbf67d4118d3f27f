"""OpenRLHF v0.10.1 flags with behaviour, end to end on the demo (real Ray, DeepSpeed, vLLM):
--freezing_actor_steps, --disable_ds_ckpt and --use_dynamic_batch in one short run.

With --freezing_actor_steps 1 the actor sits out steps 1 and 2 (OpenRLHF's `step index > N` with indices from 0),
so the HF actors saved after those steps are bit-equal to the initial model while the critic trains, the
engines are not synced (weight_version stays 0), and step 3 moves the actor. --disable_ds_ckpt checkpoints
hold the HF actor and no DeepSpeed state, and resuming from one is refused by name.
"""

import json
from pathlib import Path

import pytest
import torch

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]


def run(*flags: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--device", "cpu", *flags])
    return exit_.value.code


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_frozen_actor_hf_only_checkpoints_dynamic_batch(ray_local, tmp_path, capsys):
    from orlhf.demo.builder import ensure_demo

    save = tmp_path / "run"
    flags = (
        "--save_path",
        str(save),
        "--max_samples",
        "192",
        "--num_episodes",
        "1",
        "--freezing_actor_steps",
        "1",
        "--save_steps",
        "1",
        "--disable_ds_ckpt",
        "--use_dynamic_batch",
        "--train_max_tokens_per_gpu",
        "300",
        "--packing_samples",
    )
    assert run(*flags) == 0
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert [r["weight_version"] for r in rows] == [0, 0, 1]  # no sync while frozen
    assert [r["policy_loss"] is None for r in rows] == [True, True, False]
    assert all(r["critic_grad_norm"] > 0 and r["critic_lr"] > 0 for r in rows)  # the critic trains throughout
    initial = weights(Path(ensure_demo().model))
    ckpts = save / "checkpoints_ppo"
    for step, frozen in ((1, True), (2, True), (3, False)):
        folder = ckpts / f"step_{step:06d}"
        assert not (folder / "actor").exists() and not (folder / "critic").exists()  # no DeepSpeed state
        saved = weights(folder / "hf" / "actor")
        assert saved.keys() == initial.keys()
        same = all(torch.equal(saved[k], initial[k]) for k in initial)
        assert same == frozen, step
        assert json.loads((folder / "meta.json").read_text())["resumable"] is False
    capsys.readouterr()
    assert run(*flags, "--load_checkpoint") == 1
    err = capsys.readouterr().err
    assert "--disable_ds_ckpt" in err and "step_000003" in err, err
