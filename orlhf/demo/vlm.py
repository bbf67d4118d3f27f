"""The vision-language demo: a tiny Idefics3, its processor and an image task, all built locally from code.

The ground for vision-language RL on machines that cannot reach the hub: a randomly initialised
Idefics3ForConditionalGeneration (SigLIP-style vision tower, pixel-shuffle connector, Llama text model) small enough
to train on a CPU, that transformers and vLLM (its CPU build included) both load, and a task whose answer is in the
image, so a policy can only learn it by looking.

    <out_dir>/
        model/            HF folder: Idefics3 (2 vision blocks, 2 Llama layers, random init), its processor
                          (Idefics3 image processor, no splitting + a byte-level BPE tokenizer with Idefics3's image
                          tokens) and chat template
        images/NNNNN.png  IMAGE_SIZE x IMAGE_SIZE: one filled shape of one colour on a gray background
        prompts.jsonl     NUM_PROMPTS rows in OpenRLHF's VLM format (--input_key prompt --label_key label
                          --image_key images --apply_chat_template):
                          {"prompt": [{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": QUESTION}]}],
                           "images": ["<out_dir>/images/00000.png"], "label": "red"}
        reward_func.py    a copy of orlhf/demo/vlm_reward.py: 1.0 when the response names the image's colour
                          and no other, 0.1 for only wrong or several colours, 0.0 for none
        vlm_demo.json     what was built (version, seed), written last

Why Idefics3: the CPU install removes torchvision (its registry builds are CUDA builds), and most VLM families need
it here: Qwen2-VL's, Qwen2.5-VL's and SmolVLM's HF processors include a torchvision video processor, and vLLM's
LLaVA, Gemma3 and Qwen modules import torchvision-only transformers code. Idefics3 loads in both without it
(docs/vlm.md lists the families tried).

The chat template turns an image item into one <image>; the processor expands it to
<fake_token_around_image><global-img>, IMAGE_TOKENS <image>, <fake_token_around_image>: 4 x 4 patches of 14 pixels,
pixel-shuffled 2 x 2 by the connector, so a prompt stays a few dozen tokens.
Image paths in the rows are absolute (OpenRLHF opens them as given): the folder is not to be moved once built.

What a VLM pipeline must handle with this model in vLLM (prompt ids, image tokens in responses, the encoder
cache after a weight sync) is in docs/vlm.md; benchmarks/probes/probe_vlm.py checks it.

Invariant: make_vlm_demo is deterministic given its seed (up to library versions).
"""

from __future__ import annotations

import json
import random
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

VLM_DEMO_VERSION = "1"
NUM_PROMPTS = 256
IMAGE_SIZE = 56  # pixels a side, drawn at the size the vision tower takes: the processor does not resize them
PATCH_SIZE = 14
SCALE_FACTOR = 2  # the connector's pixel shuffle: 2 x 2 patch features become one token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
MAX_POSITIONS = 512
VOCAB_SIZE = 1024  # an upper bound: 256 bytes + specials + merges; the corpus runs out of merges first
QUESTION = "What colour is the shape?"
BACKGROUND = (128, 128, 128)
# The colours the task uses and how they are drawn: far apart in RGB, none of them the gray background.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 180, 20),
    "blue": (20, 40, 220),
    "yellow": (240, 220, 20),
    "purple": (140, 20, 180),
    "orange": (250, 140, 0),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
}
SHAPES = ("square", "circle", "triangle")
IMAGE_TOKEN = "<image>"
# The text demo's four, then the ones Idefics3's processor writes around an image (without image splitting it never
# writes its <row_i_col_j> tile tags) and its end of turn, which it adds itself when missing.
SPECIAL_TOKENS = [
    "<s>",
    "</s>",
    "<pad>",
    "<unk>",
    IMAGE_TOKEN,
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
]
# The text demo's "user: ...\nassistant:" (orlhf/demo/builder.py), taking content lists: an image item becomes
# IMAGE_TOKEN, which the processor expands. Also what OpenRLHF's `<image>` in a string prompt turns into.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}{{ '<image>\\n' }}"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
_MANIFEST = "vlm_demo.json"
# The flags `orlhf make-demo --vlm` prints to train on the demo (train_command): OpenRLHF's VLM row keys, one image a
# prompt, a critic-free estimator over groups of samples (vision-language runs have no critic), and sizes for a
# CPU like the text demo's preset (config/flags.py). A prompt is IMAGE_TOKENS + 16 ids, well inside MAX_POSITIONS.
VLM_DEMO_FLAGS: dict[str, object] = {
    "input_key": "prompt",
    "label_key": "label",
    "image_key": "images",
    "max_images_per_prompt": 1,
    "apply_chat_template": True,
    "advantage_estimator": "group_norm",
    "n_samples_per_prompt": 4,
    "prompt_max_len": 64,
    "generate_max_len": 16,
    "rollout_batch_size": 32,
    "train_batch_size": 64,
    "micro_train_batch_size": 16,
    "micro_rollout_batch_size": 32,
    "actor_learning_rate": 2e-3,
    "lr_warmup_ratio": 0.0,
    "num_episodes": 4,
    "enforce_eager": True,
}


@dataclass(frozen=True)
class VlmDemoPaths:
    root: Path  # the demo folder
    model: Path  # HF model + processor folder
    images: Path  # the PNGs the rows name
    prompts: Path  # jsonl in OpenRLHF's VLM format (module docstring)
    reward_fn: Path  # python file defining reward_func(queries, prompts, labels) -> torch.Tensor

    @classmethod
    def under(cls, root: Path) -> VlmDemoPaths:
        return cls(
            root=root,
            model=root / "model",
            images=root / "images",
            prompts=root / "prompts.jsonl",
            reward_fn=root / "reward_func.py",
        )


def _words() -> list[str]:
    """Words the tokenizer should hold whole: the colours, the shapes, the question, the text demo's fillers."""
    from orlhf.demo.builder import FILLER_WORDS

    question = QUESTION.lower().rstrip("?").split()
    return list(dict.fromkeys([*COLOURS, *SHAPES, *question, "user", "assistant", "image", *FILLER_WORDS]))


def _corpus(rng: random.Random, lines: int = 3000) -> list[str]:
    """Text in the shapes the model sees: templated turns with the image token, answers, word lists."""
    words = _words()
    out = []
    for i in range(lines):
        answer = " ".join(rng.choices(words, k=rng.randint(1, 6)))
        if i % 2:
            out.append(f"user: {IMAGE_TOKEN}\n{QUESTION}\nassistant: {answer}")
        else:
            out.append(f"The shape is {rng.choice(list(COLOURS))}. {answer}")
    return out


def build_tokenizer(rng: random.Random):
    """A byte-level BPE tokenizer as the text demo's (orlhf/demo/builder.py), with Idefics3's image tokens."""
    from orlhf.demo.builder import byte_level_bpe

    return byte_level_bpe(_corpus(rng), VOCAB_SIZE, SPECIAL_TOKENS, MAX_POSITIONS, CHAT_TEMPLATE)


def build_processor(tokenizer):
    """Idefics3's processor: its image processor at IMAGE_SIZE pixels, one tile per image, and the tokenizer."""
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    images = Idefics3ImageProcessor(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,  # one global tile: IMAGE_TOKENS per image, not a grid of tiles
    )
    return Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_TOKENS, chat_template=CHAT_TEMPLATE
    )


def build_model(tokenizer, seed: int):
    """A random Idefics3: a 2-block vision tower, the pixel-shuffle connector, a 2-layer Llama (the text demo's)."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=MAX_POSITIONS,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=SCALE_FACTOR,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    from orlhf.demo.builder import seeded_model

    return seeded_model(Idefics3ForConditionalGeneration, config, seed, tokenizer)


def draw(colour: str, shape: str, rng: random.Random):
    """One IMAGE_SIZE-pixel RGB image: a filled shape of the colour, at a random place and size, on gray."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    size = rng.randint(IMAGE_SIZE // 3, IMAGE_SIZE * 2 // 3)
    x, y = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)
    box, fill, pen = (x, y, x + size, y + size), COLOURS[colour], ImageDraw.Draw(img)
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return img


def prompt_row(image_path: str, colour: str) -> dict:
    """One prompt row in OpenRLHF's VLM format."""
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    return {"prompt": [{"role": "user", "content": content}], "images": [image_path], "label": colour}


@contextmanager
def _quiet_transformers():
    """transformers warnings off while building: without torchvision the image processor says it falls back to its
    PIL backend (the one this demo is checked with), and saving an Idefics3 config compares it with a default one,
    whose default text config warns that its pad token is outside its vocabulary (not the config saved)."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def make_vlm_demo(out_dir: Path, seed: int = 0) -> VlmDemoPaths:
    """Build the VLM demo into out_dir (created if needed). Same seed, same files (up to library versions)."""
    paths = VlmDemoPaths.under(Path(out_dir).resolve())
    paths.model.mkdir(parents=True, exist_ok=True)
    paths.images.mkdir(exist_ok=True)
    rng = random.Random(seed)
    tokenizer = build_tokenizer(rng)
    from orlhf.demo.builder import quiet_save

    with _quiet_transformers(), quiet_save():
        build_processor(tokenizer).save_pretrained(paths.model)
        build_model(tokenizer, seed).save_pretrained(paths.model, safe_serialization=True)
    with open(paths.prompts, "w") as f:
        for i in range(NUM_PROMPTS):
            colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
            image = paths.images / f"{i:05d}.png"
            draw(colour, shape, rng).save(image)
            f.write(json.dumps(prompt_row(str(image), colour)) + "\n")
    shutil.copyfile(Path(__file__).with_name("vlm_reward.py"), paths.reward_fn)
    (paths.root / _MANIFEST).write_text(json.dumps({"version": VLM_DEMO_VERSION, "seed": seed}) + "\n")
    return paths


def train_command(paths: VlmDemoPaths) -> str:
    """The `orlhf train-ppo` command line that trains on the demo at `paths` (VLM_DEMO_FLAGS)."""
    flags = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in VLM_DEMO_FLAGS.items())
    inputs = f"--pretrain {paths.model} --prompt_data {paths.prompts}"
    return f"orlhf train-ppo {inputs} {flags} --remote_rm_url {paths.reward_fn}"
