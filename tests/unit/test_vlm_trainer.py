"""The trainer side of vision-language models, pure parts: which workers get image inputs and freezing from the flags,
which modules --freeze_visual_encoder leaves trainable, when positions are the model's own (M-RoPE), and when the LM
head may run in chunks. The workers themselves: tests/workers/test_vlm_worker_mp.py."""

import dataclasses
from types import SimpleNamespace

import pytest
from torch import nn

from orlhf.config.worker_config import role_config, worker_config
from orlhf.workers.causal_lm import _mrope
from orlhf.workers.lm_head import chunked_head
from orlhf.workers.loading import causal_lm_class, freeze_visual_encoder, language_parts


def test_image_prompts_reach_every_causal_lm_and_freezing_only_the_trained_one():
    from orlhf.config.flags import parse_config
    from orlhf.config.resolve import resolve_device

    flags = {"pretrain": "model", "use_kl_loss": True}
    cfg = resolve_device(parse_config(flags, set(flags)), "cpu")
    text = worker_config(cfg, "actor")
    assert not text.vision and not text.freeze_visual_encoder
    data = dataclasses.replace(cfg.data, max_images_per_prompt=2, freeze_visual_encoder=True)
    cfg = dataclasses.replace(cfg, data=data)
    actor, ref = worker_config(cfg, "actor"), worker_config(cfg, "ref")
    assert actor.vision and ref.vision
    assert actor.freeze_visual_encoder and not ref.freeze_visual_encoder  # the reference trains nothing anyway


class _Toy(nn.Module):
    """A vision tower, a projector, a language model under `name`, a head; get_decoder as transformers' default
    (the model itself when it finds nothing)."""

    def __init__(self, name: str, decoder: bool):
        super().__init__()
        inner = nn.Module()
        inner.vision_tower, inner.projector = nn.Linear(2, 2), nn.Linear(2, 2)
        setattr(inner, name, nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 2)))
        self.model, self.lm_head, self._name, self._decoder = inner, nn.Linear(2, 4, bias=False), name, decoder

    def get_decoder(self):
        return getattr(self.model, self._name) if self._decoder else self

    def get_output_embeddings(self):
        return self.lm_head


@pytest.mark.parametrize("name, decoder", [("language_model", True), ("language_model", False), ("text_model", False)])
def test_freezing_keeps_the_language_model_and_head_trainable(name, decoder):
    model = _Toy(name, decoder)
    assert language_parts(model) == [getattr(model.model, name), model.lm_head]
    frozen = freeze_visual_encoder(model)
    assert sorted(frozen) == [f"model.{m}.{p}" for m in ("projector", "vision_tower") for p in ("bias", "weight")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.{name}.0.weight", f"model.{name}.1.weight", f"model.{name}.1.bias", "lm_head.weight"}


def test_freezing_refuses_a_model_without_a_separate_language_model():
    model = _Toy("decoder_stack", False)  # neither found by get_decoder nor named language_model / text_model
    with pytest.raises(ValueError, match="--freeze_visual_encoder"):
        freeze_visual_encoder(model)
    assert all(p.requires_grad for p in model.parameters())


def test_idefics3_freezes_its_vision_tower_and_connector():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = Idefics3Config(
        vision_config=dict(**small, image_size=28, patch_size=14),
        text_config=dict(**small, model_type="llama", vocab_size=32, num_key_value_heads=2),
    )
    model = Idefics3ForConditionalGeneration(config)
    frozen = freeze_visual_encoder(model)
    assert frozen and all(n.startswith(("model.vision_model.", "model.connector.")) for n in frozen)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if n.startswith(("model.text_model.", "lm_head."))
    }
    assert not _mrope(model)  # Llama's 1-D RoPE: the worker passes positions


def test_mrope_is_read_from_the_text_config_or_the_model():
    def model(rope, **attrs):
        text = SimpleNamespace(rope_parameters=rope)
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text), **attrs)

    assert _mrope(model({"rope_type": "default", "mrope_section": [16, 24, 24]}))
    assert not _mrope(model({"rope_type": "default"}))
    inner = SimpleNamespace(get_rope_index=lambda *a: None)  # Qwen2-VL's model: a default section without one
    assert _mrope(model({"rope_type": "default"}, model=inner))


def test_image_prompts_refuse_a_text_model(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--max_images_per_prompt"):
        causal_lm_class(role_config("ref", model_path=str(tmp_path), device="cpu", vision=True))
    assert causal_lm_class(role_config("ref", model_path=str(tmp_path), device="cpu")).__name__ == (
        "AutoModelForCausalLM"
    )


def test_chunked_head_reads_a_vlm_text_config():
    head = nn.Linear(4, 1000, bias=False)

    def vlm(**text):
        cfg = SimpleNamespace(get_text_config=lambda: SimpleNamespace(**text))
        return SimpleNamespace(config=cfg, get_output_embeddings=lambda: head)

    assert chunked_head(vlm(), 100, 0.001) is not None
    assert chunked_head(vlm(final_logit_softcapping=30.0), 100, 0.001) is None  # Gemma 3's, in its text config
