"""The VLM demo (orlhf/demo/vlm.py): it builds offline, its rows become image prompts, its model runs, its reward
scores the colour. vLLM's side is benchmarks/probes/probe_vlm.py (it starts an engine: too slow for a unit test)."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub; set before transformers loads

import pytest
import torch

from orlhf.demo.vlm import COLOURS, IMAGE_SIZE, IMAGE_TOKENS, NUM_PROMPTS, QUESTION, VlmDemoPaths, make_vlm_demo
from orlhf.demo.vlm_reward import NO_COLOUR, OTHER_COLOUR, RIGHT, reward_func


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> VlmDemoPaths:
    return make_vlm_demo(tmp_path_factory.mktemp("vlm"), seed=0)


@pytest.fixture(scope="module")
def rows(demo) -> list[dict]:
    return [json.loads(line) for line in demo.prompts.read_text().splitlines()]


@pytest.fixture(scope="module")
def processor(demo):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(demo.model)


@pytest.fixture(scope="module")
def encoded(processor, rows):
    """The first row as the trainer would feed it: chat template, then the processor with its image."""
    from PIL import Image

    row = rows[0]
    text = processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[Image.open(row["images"][0])], return_tensors="pt")


def test_demo_writes_the_layout_and_openrlhf_rows(demo, rows):
    for f in ["config.json", "model.safetensors", "tokenizer.json", "processor_config.json", "chat_template.jinja"]:
        assert (demo.model / f).is_file(), f
    assert demo.reward_fn.read_text() == (Path(__file__).parents[2] / "orlhf/demo/vlm_reward.py").read_text()
    assert len(rows) == NUM_PROMPTS
    # OpenRLHF's VLM row: a chat whose user turn holds an image item and the question, image paths, a label.
    assert rows[0]["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    assert {r["label"] for r in rows} == set(COLOURS)  # 256 draws over 8 colours: every colour appears


def test_each_image_shows_its_labels_colour(rows):
    from PIL import Image

    for row in rows[:16]:
        (path,) = row["images"]
        img = Image.open(path)
        assert img.size == (IMAGE_SIZE, IMAGE_SIZE) and Path(path).is_absolute()
        colours = {c for _, c in img.convert("RGB").getcolors()}
        assert COLOURS[row["label"]] in colours
        assert not (colours & {rgb for name, rgb in COLOURS.items() if name != row["label"]})


def test_processor_expands_the_image_into_placeholder_tokens(processor, encoded):
    ids = encoded["input_ids"][0].tolist()
    assert ids.count(processor.image_token_id) == IMAGE_TOKENS
    assert ids.count(processor.fake_image_token_id) == 2  # one each side of the image's tokens
    assert tuple(encoded["pixel_values"].shape) == (1, 1, 3, IMAGE_SIZE, IMAGE_SIZE)  # (B, images, C, H, W)
    assert processor.tokenizer.decode(ids).endswith(f"\n{QUESTION}\nassistant:")


def test_model_forward_gives_vocab_logits_that_depend_on_the_image(demo, processor, encoded):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(demo.model).eval()
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    with torch.no_grad():
        logits = model(**encoded).logits
        other = model(**{**encoded, "pixel_values": 1.0 - encoded["pixel_values"]}).logits
    assert logits.shape == (1, encoded["input_ids"].shape[1], len(processor.tokenizer))  # (B, T, V)
    assert not torch.allclose(logits[0, -1], other[0, -1])  # the answer's logits see the pixels


def test_reward_scores_the_colour_word():
    prompt = "user: <image>\nWhat colour is the shape?\nassistant:"
    responses = [" red", " It is red. red</s>", " blue", " red or blue", " big house", ""]
    got = reward_func([prompt + r for r in responses], [prompt] * len(responses), ["red"] * len(responses))
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([RIGHT, RIGHT, OTHER_COLOUR, OTHER_COLOUR, NO_COLOUR, NO_COLOUR])
    # The prompt's own words never count: only what follows it.
    assert reward_func(["the shape is red: " + " blue"], ["the shape is red: "], ["blue"]).tolist() == [RIGHT]


def test_reward_refuses_labels_that_are_not_colours():
    with pytest.raises(ValueError, match="not one of the demo's colours"):
        reward_func(["x red"], ["x"], ["colors"])
    with pytest.raises(ValueError, match="one label"):
        reward_func(["x red"], ["x"], None)


def test_make_demo_terminal_shows_only_its_own_lines(tmp_path):
    """No library chatter on the terminal: no save_pretrained progress bar, no DeepSpeed accelerator guess."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    res = subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "make-demo", "--vlm", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stderr
    lines = (res.stdout + res.stderr).splitlines()
    assert [line.split(":")[0] for line in lines] == ["model", "images", "prompts", "reward", "train on it"], lines
