"""OpenRLHF-format reward model and critic through the real workers (DeepSpeed ZeRO-3 on gloo, one spawned rank):
the scores and values equal a hand computation from the saved tensors, with OpenRLHF's (x - mean) / std.

The folder is built here as OpenRLHF's save_model writes it: "model.*" backbone tensors and the old head name
"value_head.weight" in model.safetensors; config.json with architectures ["RewardModel"], normalize_reward, mean
and std. The rank runs RewardWorker.scores, CriticWorker.values and one critic train_step, and writes them back.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks

from orlhf.config.worker_config import role_config
from orlhf.types import Experience, SequenceBatch

B, P, A, V, H = 6, 5, 4, 128, 64
MEAN, STD = -0.7, 3.0


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=V,
        max_position_embeddings=64,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import LlamaModel

    root = tmp_path_factory.mktemp("openrlhf_rm")
    torch.manual_seed(0)
    backbone = LlamaModel(_config()).eval()
    head = torch.randn(1, H) / H**0.5
    sd = {f"model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    save_file({**sd, "value_head.weight": head}, str(root / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**_config().to_dict(), "architectures": ["RewardModel"], "normalize_reward": True, "mean": MEAN, "std": STD}
    (root / "config.json").write_text(json.dumps(cfg))
    return {"root": root, "backbone": backbone, "head": head}


def _batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(11)
    seq = torch.randint(4, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    for i in range(B):
        attn[i, : i % P] = 0  # left-padded prompts
        attn[i, P + 1 + i % A :] = 0  # right-padded responses
    seq[attn == 0] = 0
    return SequenceBatch(seq, attn, attn[:, -A:].bool())


def _rank_main(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    from orlhf.workers import CriticWorker, RewardWorker

    batch = _batch()
    heads = dict(
        model_path=path,
        device="cpu",
        zero_stage=3,
        micro_forward_batch_size=4,
        value_head_prefix="value_head",
        normalize_reward=True,
    )
    reward = RewardWorker(role_config("reward", **heads))
    reward.init()
    critic = CriticWorker(
        role_config(
            "critic",
            learning_rate=1e-3,
            train_batch_size=B,
            value_clip=0.5,
            micro_train_batch_size=3,
            total_optimizer_steps=2,
            **heads,
        )
    )
    critic.init()
    out = {"scores": reward.scores(batch), "values": critic.values(batch)}
    g = torch.Generator().manual_seed(5)
    exp = Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=torch.zeros(B, A),
        advantages=torch.randn(B, A, generator=g),
        returns=torch.randn(B, A, generator=g),
        values=out["values"],
        base_action_log_probs=torch.zeros(B, A),
    )
    out["critic_stats"] = critic.train_step(exp)
    torch.save(out, Path(out_dir) / "out.pt")


@pytest.fixture(scope="module")
def ran(folder):
    spawn_ranks(_rank_main, 1, str(folder["root"]), str(folder["root"]))
    return torch.load(folder["root"] / "out.pt", weights_only=False)


def _hand_values(folder) -> torch.Tensor:
    """(B, T): the saved backbone's last hidden states times the saved head, then (v - mean) / std."""
    batch = _batch()
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = folder["backbone"](
            input_ids=batch.sequences, attention_mask=batch.attention_mask, position_ids=pos
        ).last_hidden_state
    return ((hidden.double() @ folder["head"].double().T).squeeze(-1) - MEAN) / STD


def test_reward_worker_scores_are_the_saved_head_normalized(ran, folder):
    batch = _batch()
    per_token = _hand_values(folder)
    last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.flip(-1).argmax(-1)
    expect = per_token.gather(1, last[:, None]).squeeze(1)
    assert (ran["scores"].double() - expect).abs().max().item() <= 1e-5
    assert expect.std() > 0.1  # the scores differ by sequence: a zero or constant head could not pass


def test_critic_worker_values_and_train_step(ran, folder):
    batch = _batch()
    expect = _hand_values(folder)[:, -A - 1 : -1] * batch.action_mask
    assert (ran["values"].double() - expect).abs().max().item() <= 1e-5
    stats = ran["critic_stats"]
    assert torch.isfinite(torch.tensor(stats.loss)) and stats.grad_norm > 0
