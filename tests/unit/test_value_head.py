"""Reward models and critics in OpenRLHF's format: the head named by --value_head_prefix, read from the files and
used; mean/std from config.json applied with --normalize_reward as OpenRLHF applies them; a missing or misshapen
head is an error naming the folder, the prefix and the tensors found. Plain transformers models, no DeepSpeed
(tests/workers/test_value_head_mp.py runs the same folders through the real workers)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from orlhf.config.worker_config import role_config
from orlhf.inputs.head_files import HeadError, check_head, reward_normalization, stored_reward_stats, tensor_shapes
from orlhf.workers.critic import ValueModel, load_value_model

H, V = 64, 128
MEAN, STD = 0.3, 2.5


def tiny_config(**kw):
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
        **kw,
    )


def save_openrlhf_model(
    folder, prefix="value_head", seed=0, arch="RewardModel", stats=True, extra=None, head_shape=(1, H)
):
    """A folder as OpenRLHF's save_model writes a reward model: "model.*" backbone tensors + "<prefix>.weight" in
    model.safetensors, and config.json with architectures, normalize_reward, mean and std."""
    from safetensors.torch import save_file
    from transformers import LlamaModel

    torch.manual_seed(seed)
    backbone = LlamaModel(tiny_config()).eval()
    sd = {f"model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    if prefix is not None:
        sd[f"{prefix}.weight"] = torch.randn(head_shape) / H**0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = tiny_config().to_dict()
    cfg.update(architectures=[arch])
    cfg.update({"normalize_reward": True, "mean": MEAN, "std": STD} if stats else {})
    cfg.update(extra or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    return backbone, sd.get(f"{prefix}.weight")


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, V, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    ids[mask == 0] = 0
    return ids, mask


def hand_values(backbone, w, ids, mask):
    """(B, T) hidden states of the saved backbone times the saved head: the value at every position."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    return (hidden.double() @ w.double().T).squeeze(-1)


def wcfg(path, role="reward", **kw):
    return role_config(role, model_path=str(path), device="cpu", **kw)


def test_openrlhf_value_head_is_loaded_and_normalized_as_openrlhf(tmp_path):
    backbone, w = save_openrlhf_model(tmp_path / "rm")
    ids, mask = batch()
    expect = hand_values(backbone, w, ids, mask)  # (B, T)
    model = load_value_model(
        wcfg(tmp_path / "rm", value_head_prefix="value_head", normalize_reward=True), required=True
    ).eval()
    with torch.no_grad():
        got = model(ids, mask)
    assert torch.allclose(got.double(), (expect - MEAN) / STD, atol=1e-5)
    raw = load_value_model(wcfg(tmp_path / "rm", value_head_prefix="value_head"), required=True).eval()
    with torch.no_grad():
        assert torch.allclose(raw(ids, mask).double(), expect, atol=1e-5)  # no flag: the raw score, as OpenRLHF
    assert set(model.state_dict()) == set(raw.state_dict())  # normalization adds no tensor to checkpoints


def test_critic_normalizes_in_training_too_and_keeps_its_head_name(tmp_path):
    backbone, w = save_openrlhf_model(tmp_path / "rm", prefix="score", arch="CriticModel")
    ids, mask = batch()
    critic = load_value_model(wcfg(tmp_path / "rm", role="critic", normalize_reward=True)).train()
    got = critic(ids, mask)
    assert torch.allclose(got.double(), (hand_values(backbone, w, ids, mask) - MEAN) / STD, atol=1e-5)
    assert "value_head.weight" in dict(critic.named_parameters())  # checkpoints of earlier runs stay loadable
    got.sum().backward()
    assert critic.value_head.weight.grad is not None


def test_hf_sequence_classifier_score_head_is_the_default(tmp_path):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    hf = LlamaForSequenceClassification(tiny_config(num_labels=1)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids, mask = batch()
    model = load_value_model(wcfg(tmp_path / "hf"), required=True).eval()
    expect = hand_values(hf.model, hf.score.weight.detach(), ids, mask)
    with torch.no_grad():
        assert torch.allclose(model(ids, mask).double(), expect, atol=1e-5)


def test_missing_head_names_folder_prefix_tensor_and_what_is_there(tmp_path):
    save_openrlhf_model(tmp_path / "old", prefix="value_head")
    with pytest.raises(HeadError) as e:
        load_value_model(wcfg(tmp_path / "old"), required=True)  # default prefix "score"
    msg = str(e.value)
    for part in (
        str(tmp_path / "old"),
        "'score.weight'",
        "--value_head_prefix score",
        f"value_head.weight [1, {H}]",
        "Pass --value_head_prefix value_head",
    ):
        assert part in msg, (part, msg)
    with pytest.raises(HeadError, match="'score.weight'"):  # the driver's pre-flight says the same, from files
        check_head(str(tmp_path / "old"), "score", required=True)
    with pytest.raises(HeadError, match="its config.json says RewardModel"):  # the critic refuses a random head too
        load_value_model(wcfg(tmp_path / "old", role="critic"))


def test_reward_model_without_any_head_is_an_error_and_critic_starts_fresh(tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(tiny_config()).save_pretrained(tmp_path / "lm")
    with pytest.raises(HeadError, match=r"no value head 'score.weight'.*a reward model needs one.*no head-like"):
        load_value_model(wcfg(tmp_path / "lm"), required=True)
    a = load_value_model(wcfg(tmp_path / "lm", role="critic", seed=5))
    b = load_value_model(wcfg(tmp_path / "lm", role="critic", seed=5))
    assert torch.equal(a.value_head.weight, b.value_head.weight) and a.value_head.weight.abs().sum() > 0
    check_head(str(tmp_path / "lm"), "score", required=False)  # the pre-flight agrees: no error


def test_head_of_the_wrong_shape_is_an_error(tmp_path):
    save_openrlhf_model(tmp_path / "two", prefix="score", head_shape=(2, H))
    with pytest.raises(HeadError, match=rf"'score.weight' has shape \[2, {H}\]; a reward/critic head is \[1, {H}\]"):
        load_value_model(wcfg(tmp_path / "two"), required=True)


def test_prefix_recorded_in_config_wins_as_in_openrlhf(tmp_path):
    backbone, w = save_openrlhf_model(tmp_path / "rm", prefix="my_head", extra={"value_head_prefix": "my_head"})
    model = load_value_model(wcfg(tmp_path / "rm"), required=True).eval()  # flag: default "score"
    ids, mask = batch()
    with torch.no_grad():
        assert torch.allclose(model(ids, mask).double(), hand_values(backbone, w, ids, mask), atol=1e-5)


def test_pytorch_bin_checkpoints_are_read_too(tmp_path):
    from safetensors.torch import load_file

    save_openrlhf_model(tmp_path / "rm")

    sd = load_file(str(tmp_path / "rm" / "model.safetensors"))
    torch.save(sd, tmp_path / "rm" / "pytorch_model.bin")
    (tmp_path / "rm" / "model.safetensors").unlink()
    assert tensor_shapes(str(tmp_path / "rm"))["value_head.weight"][0] == (1, H)


def test_stored_statistics_and_which_normalization_applies(tmp_path):
    save_openrlhf_model(tmp_path / "rm")
    save_openrlhf_model(tmp_path / "plain", stats=False)
    assert stored_reward_stats(str(tmp_path / "rm")) == (MEAN, STD)
    assert stored_reward_stats(str(tmp_path / "plain")) is None
    assert reward_normalization(True, str(tmp_path / "rm")) == "stored"
    assert reward_normalization(True, str(tmp_path / "plain")) == "running"  # orlhf's running statistics stay
    assert reward_normalization(True, None) == "running"  # function / URL reward sources
    assert reward_normalization(False, str(tmp_path / "rm")) == "off"
    save_openrlhf_model(tmp_path / "bad", extra={"std": 0.0})
    with pytest.raises(HeadError, match=r"bad/config.json: reward statistics mean=0.3, std=0.0"):
        stored_reward_stats(str(tmp_path / "bad"))


def test_value_model_normalize_is_plain_arithmetic():
    class Backbone(torch.nn.Module):
        base_model_prefix = "model"
        config = None

        def forward(self, input_ids, **kw):
            return type("O", (), {"last_hidden_state": input_ids.float().unsqueeze(-1)})

    head = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(head.weight)
    m = ValueModel(Backbone(), head, normalize=(1.0, 4.0))
    ids = torch.tensor([[1, 5, 9]])
    assert m(ids, torch.ones_like(ids)).tolist() == [[0.0, 1.0, 2.0]]  # (x - 1) / 4


def test_a_corrupt_weights_file_is_named_by_the_pre_flight(tmp_path):
    save_openrlhf_model(tmp_path / "rm", prefix="score")
    (tmp_path / "rm" / "model.safetensors").write_bytes(b"not a safetensors file")
    for required in (True, False):  # reward model and critic alike: one line naming the file, not a traceback
        with pytest.raises(HeadError, match=r"model\.safetensors: cannot read the model's weights"):
            check_head(str(tmp_path / "rm"), "score", required=required)


def test_pre_flight_reads_width_and_backbone_from_the_files_without_transformers_configs(tmp_path):
    import subprocess
    import sys

    from orlhf.inputs.head_files import backbone_prefix_of, config_hidden_size

    assert config_hidden_size({"hidden_size": 64}) == 64
    assert config_hidden_size({"n_embd": 48}) == 48  # GPT-2's name for it
    assert config_hidden_size({"text_config": {"hidden_size": 32}}) == 32  # a multimodal wrapper's language model
    assert config_hidden_size({"hidden_size": True}) is None and config_hidden_size({}) is None
    shapes = {
        "transformer.h.0.attn.c_attn.weight": ((4, 4), None),
        "transformer.wte.weight": ((8, 4), None),
        "lm_head.weight": ((8, 4), None),
        "score.weight": ((1, 4), None),
    }
    assert backbone_prefix_of(shapes) == "transformer"

    # A GPT-2-shaped reward model ("transformer.*" backbone, n_embd): a head of the wrong width is still caught.
    save_openrlhf_model(tmp_path / "gpt2ish", prefix="score", head_shape=(1, H + 1))
    cfg = json.loads((tmp_path / "gpt2ish" / "config.json").read_text())
    cfg["n_embd"] = cfg.pop("hidden_size")
    (tmp_path / "gpt2ish" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadError, match=rf"'score.weight' has shape \[1, {H + 1}\]"):
        check_head(str(tmp_path / "gpt2ish"), "score", required=True)

    # The check runs on the driver before Ray starts: no torch, no transformers config machinery (its type
    # validators import torch's compiler and DTensor modules).
    save_openrlhf_model(tmp_path / "rm", prefix="score")
    code = (
        "import sys; from orlhf.inputs.head_files import check_head; "
        f"check_head({str(tmp_path / 'rm')!r}, 'score', required=True); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_pre_flight_names_a_truncated_weights_file(tmp_path):
    save_openrlhf_model(tmp_path / "rm", prefix="score")
    f = tmp_path / "rm" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # an interrupted download: the header is whole, the data is not
    with pytest.raises(HeadError, match=r"model\.safetensors: cannot read the model's weights .*past the file's"):
        check_head(str(tmp_path / "rm"), "score", required=True)
