"""The data side of vision-language prompts (--max_images_per_prompt > 0): a row's images and their errors
(inputs/images.py), image prompts' two tokenizations on the demo's processor (inputs/prompts.py), the flag
combinations refused before Ray starts (config/validation_vision.py, launch/preflight.py), `make-demo --vlm`."""

import base64
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub; set before transformers loads

import pytest

from orlhf.config.flags import build_config, parse_config
from orlhf.config.train_config import ConfigError
from orlhf.demo.vlm import IMAGE_TOKENS, QUESTION, make_vlm_demo
from orlhf.inputs.errors import DataError
from orlhf.inputs.images import image_token_ids, load_processor, prompt_vision, row_images
from orlhf.inputs.prompt_rows import load_prompt_rows
from orlhf.inputs.prompts import build_prompts, format_prompts
from orlhf.inputs.tokenizer import load_tokenizer

WHERE = "p.jsonl line 3"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_vlm_demo(tmp_path_factory.mktemp("vlm"), seed=0)


@pytest.fixture(scope="module")
def processor(demo):
    return load_processor(str(demo.model))


@pytest.fixture(scope="module")
def tok(demo):
    return load_tokenizer(str(demo.model))


@pytest.fixture(scope="module")
def png(demo) -> bytes:
    return (demo.images / "00000.png").read_bytes()


def vlm_prompts(rows, tok, processor, max_len=64, chat=True, max_images=1, **kw):
    return build_prompts(
        rows, tok, "prompt", None, chat, None, max_len, processor=processor, max_images=max_images, **kw
    )


def chat(*parts: str) -> list[dict]:
    """A one-turn conversation of image ("<img>") and text parts, in OpenRLHF's VLM format."""
    items = [{"type": "image"} if p == "<img>" else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": items}]


# ---- a row's images ----


def test_row_images_accepts_paths_bytes_parquet_dicts_and_data_uris(demo, png, tmp_path, monkeypatch):
    path = demo.images / "00000.png"
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    for value in (str(path), [str(path)], png, {"bytes": png, "path": None}, {"bytes": None, "path": str(path)}, uri):
        assert row_images({"images": value}, "images", 2, WHERE, None) == (png,), type(value)
    # A relative path: from the working directory first, then from the data file's folder.
    assert row_images({"images": "images/00000.png"}, "images", 1, WHERE, demo.root) == (png,)
    monkeypatch.chdir(demo.root)
    assert row_images({"images": "images/00001.png"}, "images", 1, WHERE, None) == (
        (demo.images / "00001.png").read_bytes(),
    )
    assert row_images({"images": [str(path), png]}, "images", 2, WHERE, None) == (png, png)
    for text_row in ({}, {"images": None}, {"images": []}, {"images": [None]}):  # no images: a text row
        assert row_images(text_row, "images", 1, WHERE, None) == ()


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "https://x.org/a.png",
            r"p\.jsonl line 3: image 1 in 'images' \(--image_key\) is a URL .*orlhf does not "
            r"download images: download them and give paths",
        ),
        ("gone.png", r"p\.jsonl line 3: image 1 in 'images' \(--image_key\): no such file gone\.png .*fix the path"),
        (b"not a png", r"p\.jsonl line 3: image 1 .* is not an image PIL can open .*fix or remove that row"),
        (
            ["a.png", "b.png"],
            r"p\.jsonl line 3: 2 images in 'images' \(--image_key\), more than "
            r"--max_images_per_prompt 1; raise --max_images_per_prompt",
        ),
        (7, r"p\.jsonl line 3: image 1 in 'images' \(--image_key\) is a int; give a file path, encoded image bytes"),
    ],
)
def test_row_image_errors_name_the_row_and_the_fix(value, message, tmp_path):
    with pytest.raises(DataError, match=message):
        row_images({"images": value}, "images", 1, WHERE, tmp_path)


def test_a_truncated_png_fails_at_reading_not_in_a_step(png):
    with pytest.raises(DataError, match="is not an image PIL can open"):
        row_images({"images": png[: len(png) // 2]}, "images", 1, WHERE, None)


def test_errors_of_a_mixed_source_name_its_file_and_line(demo, tmp_path):
    from orlhf.inputs.prompt_mix import load_prompt_mix

    good = {"prompt": chat("<img>", QUESTION), "images": [str(demo.images / "00000.png")]}
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text(json.dumps(good) + "\n")
    b.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "images": ["missing.png"]}) + "\n")
    rows = load_prompt_mix(f"{a},{b}", None, "train", "prompt", None, None, 0)
    cfg = parse_config(
        {"pretrain": str(demo.model), "max_images_per_prompt": 1, "apply_chat_template": True, "input_key": "prompt"}
    )
    with pytest.raises(DataError, match=rf"{b} line 3: image 1 in 'images' .*no such file missing\.png .*{tmp_path}"):
        format_prompts(rows, load_tokenizer(str(demo.model)), cfg.data, 64)  # its processor loaded there


# ---- image prompts on the demo's processor ----


def test_demo_rows_get_one_placeholder_for_the_engine_and_the_expansion_for_the_trainer(demo, tok, processor):
    rows = load_prompt_rows(str(demo.prompts), "prompt", "label", 4)
    prompts, stats = build_prompts(rows, tok, "prompt", "label", True, None, 64, processor=processor, max_images=1)
    assert stats.used == 4
    image, fake, glob = (tok.convert_tokens_to_ids(t) for t in ("<image>", "<fake_token_around_image>", "<global-img>"))
    p = prompts[0]
    assert p.text == f"user: <image>\n{QUESTION}\nassistant:" and p.label == rows[0]["label"]
    assert p.engine_ids == tok(p.text, add_special_tokens=False)["input_ids"] and p.engine_ids.count(image) == 1
    # The processor's: <fake><global-img> IMAGE_TOKENS x <image> <fake> in place of the one <image>.
    at = p.engine_ids.index(image)
    assert p.ids == p.engine_ids[:at] + [fake, glob] + [image] * IMAGE_TOKENS + [fake] + p.engine_ids[at + 1 :]
    assert p.images == ((demo.images / "00000.png").read_bytes(),)


def test_image_token_ids_are_the_placeholder_and_the_tags_around_it(tok, processor):
    names = ("<image>", "<fake_token_around_image>", "<global-img>")
    assert image_token_ids(processor, tok) == sorted(tok.convert_tokens_to_ids(t) for t in names)


def test_prompt_vision_gives_the_image_tensors_only(demo, tok, processor):
    rows = [{"prompt": chat("<img>", QUESTION), "images": [str(demo.images / "00000.png")]}, {"prompt": "hi"}]
    image_prompt, text_prompt = vlm_prompts(rows, tok, processor)[0]
    vision = prompt_vision(processor, image_prompt)
    assert sorted(vision) == ["pixel_attention_mask", "pixel_values"]
    assert tuple(vision["pixel_values"].shape) == (1, 1, 3, 56, 56)  # (prompts, images, C, H, W)
    assert prompt_vision(processor, text_prompt) is None
    assert (text_prompt.images, text_prompt.engine_ids) == ((), None)  # a text row of a VLM run: engines get ids


def test_placeholders_and_images_must_match_one_for_one(demo, tok, processor):
    path = str(demo.images / "00000.png")
    with pytest.raises(DataError, match=r"row 1: the prompt holds 2 image placeholder\(s\) \(<image>\) for 1 image"):
        vlm_prompts([{"prompt": chat("<img>", "<img>", "which?"), "images": [path]}], tok, processor, max_images=2)
    with pytest.raises(DataError, match=r"row 1: the prompt holds 0 image placeholder\(s\) \(<image>\) for 1 image"):
        vlm_prompts([{"prompt": "What colour?", "images": [path]}], tok, processor, chat=False)
    with pytest.raises(DataError, match=r"holds 1 image placeholder\(s\) \(<image>\) for 0 image"):
        vlm_prompts([{"prompt": chat("<img>", QUESTION)}], tok, processor)
    # Without --apply_chat_template the text may hold the placeholder itself; OpenRLHF's "<image>" in a chat text
    # content is an image item.
    (plain,) = vlm_prompts([{"prompt": "<image> What colour?", "images": [path]}], tok, processor, chat=False)[0]
    (tagged,) = vlm_prompts([{"prompt": "<image>What colour?", "images": [path]}], tok, processor)[0]
    assert plain.engine_ids.count(4) == tagged.engine_ids.count(4) == 1 and tagged.text.startswith("user: <image>\n")


def test_bytes_and_parquet_image_rows_build_image_prompts(demo, png, tok, processor, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature
    table = pa.table(
        {"prompt": ["<image>What colour?"] * 2, "images": [[{"bytes": png, "path": None}], []]},
        schema=pa.schema([("prompt", pa.string()), ("images", pa.list_(image))]),
    )
    pq.write_table(table, tmp_path / "p.parquet")
    rows = load_prompt_rows(str(tmp_path / "p.parquet"), "prompt", None, None)
    with pytest.raises(DataError, match=r"p\.parquet row 2: the prompt holds 1 image placeholder"):
        vlm_prompts(rows, tok, processor)
    prompts, _ = vlm_prompts(rows[:1], tok, processor)
    assert prompts[0].images == (png,) and len(prompts[0].ids) == len(prompts[0].engine_ids) + IMAGE_TOKENS + 2
    (raw,) = vlm_prompts([{"prompt": chat("<img>", QUESTION), "images": png}], tok, processor)[0]
    assert raw.images == (png,)


def test_long_image_prompts_are_skipped_on_their_expanded_length_and_truncation_is_refused(demo, tok, processor):
    row = {"prompt": chat("<img>", QUESTION), "images": [str(demo.images / "00000.png")]}
    p = vlm_prompts([row], tok, processor)[0][0]
    prompts, stats = vlm_prompts([row, {"prompt": "x"}], tok, processor, max_len=len(p.ids) - 1)
    assert [q.index for q in prompts] == [1] and stats.skipped_too_long == 1  # engine_ids alone would fit
    with pytest.raises(DataError, match="no prompts left.*Raise --prompt_max_len \\(now 8\\)\\.$"):
        vlm_prompts([row], tok, processor, max_len=8)
    with pytest.raises(DataError, match="--prompt_overflow truncate with vision-language prompts"):
        vlm_prompts([row], tok, processor, overflow="truncate")


def test_content_part_lists_are_read_in_vision_runs_only(tok, processor):
    with pytest.raises(DataError, match=r"row 1: message 1 of 'prompt' .*list of content parts.*vision-language runs"):
        build_prompts([{"prompt": chat("<img>", "hi")}], tok, "prompt", None, True, None, 64)  # a text run
    (p,), _ = vlm_prompts([{"prompt": chat("hi")}], tok, processor)
    assert p.text == "user: hi\nassistant:" and p.engine_ids is None
    with pytest.raises(DataError, match=r"row 1: part 1 of message 1 of 'prompt' .*content parts are"):
        vlm_prompts([{"prompt": [{"role": "user", "content": [{"type": "video"}]}]}], tok, processor)


def test_a_text_run_says_it_leaves_the_rows_images_unused(tok, caplog):
    with caplog.at_level("WARNING", logger="orlhf.inputs.prompts"):
        build_prompts([{"prompt": "hi", "images": ["x.png"]}, {"prompt": "ho"}], tok, "prompt", None, False, None, 64)
    assert "1 prompt rows have images in 'images' (--image_key), which this text run does not use" in caplog.text


# ---- flags, before Ray starts ----


def demo_flags(demo) -> dict:
    """The demo's model, prompts and reward, at lengths within its positions."""
    paths = {"pretrain": str(demo.model), "prompt_data": str(demo.prompts), "remote_rm_url": str(demo.reward_fn)}
    return {**paths, "prompt_max_len": 64, "generate_max_len": 16}


def problems(demo, **flags) -> list[str]:
    flags = {**demo_flags(demo), **flags}
    with pytest.raises(ConfigError) as err:
        build_config(flags, explicit=set(flags))
    return err.value.problems


@pytest.mark.parametrize(
    "flags, named",
    [
        ({"advantage_estimator": "gae"}, "--advantage_estimator gae trains a critic"),
        ({"reward_pretrain": "<model>", "remote_rm_url": None}, "--reward_pretrain (a reward model) is not supported"),
        ({"packing_samples": True}, "--packing_samples is not supported"),
        ({"agent_func_path": "<agent>"}, "--agent_func_path (multi-turn agents) is not supported"),
        ({"rollout_backend": "trainer", "vllm_num_engines": 0}, "--rollout_backend trainer (generation in the actor's"),
        ({"vllm_num_engines": 0}, "--vllm_num_engines 0 (generation in the actor's"),
        ({"partial_rollout": True, "async_train": True}, "--partial_rollout is not supported"),
        ({"lora_rank": 8}, "--lora_rank 8 (LoRA) is not supported"),
        ({"prompt_overflow": "truncate"}, "--prompt_overflow truncate is not supported"),
    ],
)
def test_features_without_image_support_are_refused_by_name(demo, flags, named):
    flags = {k: str(demo.model) if v == "<model>" else v for k, v in flags.items()}
    if flags.get("agent_func_path"):
        flags["agent_func_path"] = str(demo.reward_fn)  # an existing .py: only the VLM rule is at stake
    got = problems(demo, max_images_per_prompt=1, **flags)
    mine = [p for p in got if named in p]
    assert len(mine) == 1 and "vision-language prompts (--max_images_per_prompt > 0) yet" in mine[0], got


def test_image_flag_ranges_and_pairs(demo):
    assert problems(demo, max_images_per_prompt=-1) == [
        "--max_images_per_prompt must be >= 0 (got -1; 0: text prompts only)."
    ]
    (msg,) = problems(demo, freeze_visual_encoder=True)
    assert msg.startswith("--freeze_visual_encoder freezes") and "--max_images_per_prompt N" in msg
    (msg,) = problems(demo, image_key="pictures")
    assert msg.startswith("--image_key pictures does nothing without --max_images_per_prompt")
    with pytest.raises(ConfigError, match="the built-in demo is a text model"):
        build_config({"max_images_per_prompt": 1}, explicit={"max_images_per_prompt"})
    vlm = {"max_images_per_prompt": 1, "freeze_visual_encoder": True, "advantage_estimator": "reinforce"}
    cfg = build_config({**demo_flags(demo), **vlm})
    assert cfg.data.max_images_per_prompt == 1 and cfg.data.freeze_visual_encoder


def test_preflight_refuses_a_text_model_for_image_prompts(demo, tmp_path):
    from orlhf.launch.preflight import check_vision_model

    text_model = tmp_path / "text"
    text_model.mkdir()
    (text_model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = parse_config({"pretrain": str(text_model), "max_images_per_prompt": 1})
    with pytest.raises(ConfigError, match=rf"--pretrain {text_model} is not a vision-language model \(its config"):
        check_vision_model(cfg)
    check_vision_model(parse_config({"pretrain": str(demo.model), "max_images_per_prompt": 1}))


def test_make_demo_vlm_prints_a_command_that_validates_and_plans(demo, tmp_path, capsys, no_training, monkeypatch):
    import orlhf.demo.vlm
    from orlhf.cli import main

    monkeypatch.setattr(orlhf.demo.vlm, "make_vlm_demo", lambda out, seed=0: demo)  # the module's build

    def cli(argv):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        return exit_.value.code, capsys.readouterr()

    code, out = cli(["make-demo", "--vlm", str(tmp_path / "d")])
    assert code in (None, 0), out
    (command,) = [line.split(": ", 1)[1].split() for line in out.out.splitlines() if "orlhf train-ppo" in line]
    assert command[:2] == ["orlhf", "train-ppo"]
    code, out = cli(command[1:])
    assert code == 0, out.err
    (cfg,) = no_training
    assert cfg.data.max_images_per_prompt == 1 and cfg.data.apply_chat_template and not cfg.has_critic
    code, out = cli(["plan", *command[2:], "--device", "cpu"])  # sizes the model, lengths fit its positions
    assert code == 0, out.out + out.err
