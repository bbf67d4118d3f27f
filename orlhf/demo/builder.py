"""The built-in tiny default: a model, a prompt set and a reward, all built locally from code in seconds.

`orlhf train` with no model or data runs on this demo, so a fresh install shows PPO working end to end on a CPU
with nothing downloaded (the machines this runs on cannot reach the hub). The pieces:

    <cache>/demo-v{DEMO_VERSION}/
        model/           HF folder: a 2-layer Llama (0.6M params, random init) + a byte-level BPE tokenizer
                         trained on the demo's ~200 words; loads in transformers, DeepSpeed and vLLM
                         (`orlhf make-demo --moe DIR`: a 2-layer Qwen2-MoE instead, 8 experts, top-2)
        prompts.jsonl    512 rows {"prompt": "say colors: cat run blue ...", "label": "colors"}
        reward_func.py   a copy of orlhf/demo/reward.py: share of the response's words that are colors
        agent_func.py    a copy of orlhf/demo/agent.py: the multi-turn version (--agent_func_path), 3 turns
        demo.json        what was built (version, seed), written last

The task is learnable from scratch: the vocabulary is mostly whole demo words, so a random model already says a
color now and then (a low but nonzero mean reward) and PPO only has to shift probability mass onto ~40 tokens.

Invariants: make_demo is deterministic given its seed; ensure_demo never returns a half-built folder (it builds
into a temp sibling and renames it into place under a file lock), and a cached demo is returned without
importing torch or transformers.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

DEMO_VERSION = "2"  # bump when the recipe below changes: it names the cache folder, so old caches are not reused
DEMO_LABEL = "colors"  # every prompt asks for colors: one target keeps the task learnable in minutes
NUM_PROMPTS = 512
MAX_POSITIONS = 512  # the model's max_position_embeddings: a prompt + response must fit (config/validation_inputs.py)
VOCAB_SIZE = 1024  # an upper bound: 256 bytes + 4 specials + merges; the corpus runs out of merges at ~965
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]  # ids 0..3, in this order
# "user: ...\nassistant:" - plain words the tokenizer knows, so templated prompts stay short.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
# Words that are in no reward category: they fill prompts and make the vocabulary look like a tiny language.
FILLER_WORDS = (
    "run jump eat drink see go come make take give sing play read write walk swim fly sleep look find "
    "big small fast slow hot cold happy sad old new good bad tall short soft loud "
    "house tree car boat book door window road river hill sun moon star rain snow sky stone box ball hat "
    "say user assistant system and the a with of in"
).split()
_MANIFEST = "demo.json"


@dataclass(frozen=True)
class DemoPaths:
    root: Path  # the demo folder
    model: Path  # HF model + tokenizer folder
    prompts: Path  # jsonl, one {"prompt": str, "label": str} per line
    reward_fn: Path  # python file defining reward_func(queries, prompts, labels) -> torch.Tensor
    agent_fn: Path  # python file defining AgentInstance and AgentExecutor (multi-turn demo environment)

    @classmethod
    def under(cls, root: Path) -> DemoPaths:
        return cls(
            root=root,
            model=root / "model",
            prompts=root / "prompts.jsonl",
            reward_fn=root / "reward_func.py",
            agent_fn=root / "agent_func.py",
        )


def default_cache_dir() -> Path:
    """$ORLHF_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/orlhf."""
    if os.environ.get("ORLHF_CACHE"):
        return Path(os.environ["ORLHF_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "orlhf"


def demo_words() -> list[str]:
    """Every word the demo uses, in a fixed order (category words first)."""
    from orlhf.demo.reward import CATEGORIES  # imported here: demo/reward.py imports torch

    words = [w for name in sorted(CATEGORIES) for w in sorted(CATEGORIES[name])]
    return words + [w for w in FILLER_WORDS if w not in words]


def _corpus(words: list[str], rng: random.Random, lines: int = 4000) -> list[str]:
    """Sentences in the shapes the model will see: bare word lists, demo prompts, chat-templated turns."""
    from orlhf.demo.reward import CATEGORIES

    out = []
    for i in range(lines):
        text = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        if i % 3 == 1:
            text = f"say {rng.choice(sorted(CATEGORIES))}: {text}"
        elif i % 3 == 2:
            text = f"user: say colors: {text}\nassistant: {' '.join(rng.choices(words, k=4))}"
        out.append(text)
    return out


def byte_level_bpe(corpus: list[str], vocab_size: int, special_tokens: list[str], max_positions: int, chat_template):
    """A byte-level BPE tokenizer trained on `corpus`, with <s> </s> <pad> <unk> (the text and VLM demos').

    ByteLevel on both sides: any text encodes (all 256 bytes are in the vocabulary) and decode(encode(t)) == t. No
    bos is added on encode: a prompt's tokens decode back to the prompt string exactly, which is what reward
    functions rely on to split a query into prompt and response."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_positions,
        chat_template=chat_template,
    )


def _build_tokenizer(rng: random.Random):
    return byte_level_bpe(_corpus(demo_words(), rng), VOCAB_SIZE, SPECIAL_TOKENS, MAX_POSITIONS, CHAT_TEMPLATE)


def _build_model(tokenizer, seed: int, moe: bool = False):
    """The demo's 2-layer Llama; moe: a Qwen2-MoE of the same width instead (8 experts of which each token uses 2,
    and a shared one: mixture-of-experts runs, --router_replay)."""
    import transformers

    common = dict(
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
        dtype="float32",
    )
    if not moe:
        return seeded_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**common), seed, tokenizer)
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128)
    config = transformers.Qwen2MoeConfig(**common, **experts, decoder_sparse_step=1)
    return seeded_model(transformers.Qwen2MoeForCausalLM, config, seed, tokenizer)


def seeded_model(model_cls, config, seed: int, tokenizer):
    """`model_cls(config)` randomly initialised from `seed` (the caller's RNG untouched), with the tokenizer's
    special ids in its generation_config (HF generate reads them there, not from config)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    return model


def _prompt_rows(rng: random.Random) -> list[dict]:
    words = demo_words()
    return [
        {"prompt": f"say {DEMO_LABEL}: " + " ".join(rng.choices(words, k=rng.randint(4, 12))), "label": DEMO_LABEL}
        for _ in range(NUM_PROMPTS)
    ]


def make_demo(out_dir: Path, seed: int = 0, moe: bool = False) -> DemoPaths:
    """Build the demo into out_dir (created if needed). Same seed, same files (up to library versions). moe: its
    model a tiny Qwen2-MoE (`orlhf make-demo --moe`)."""
    paths = DemoPaths.under(Path(out_dir))
    paths.model.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tokenizer = _build_tokenizer(rng)
    with quiet_save():
        tokenizer.save_pretrained(paths.model)
        _build_model(tokenizer, seed, moe).save_pretrained(paths.model, safe_serialization=True)
    with open(paths.prompts, "w") as f:
        for row in _prompt_rows(rng):
            f.write(json.dumps(row) + "\n")
    shutil.copyfile(Path(__file__).with_name("reward.py"), paths.reward_fn)
    shutil.copyfile(Path(__file__).with_name("agent.py"), paths.agent_fn)
    (paths.root / _MANIFEST).write_text(json.dumps({"version": DEMO_VERSION, "seed": seed}) + "\n")
    return paths


def make_moe_demo(out_dir: Path, seed: int = 0) -> DemoPaths:
    """The demo with a tiny Qwen2-MoE for its model (`orlhf make-demo --moe`): for --router_replay."""
    return make_demo(out_dir, seed, moe=True)


@contextmanager
def quiet_save():
    """No library output while a demo model is written: transformers' shard-writing progress bar off, and DeepSpeed's
    import-time notices dropped (accelerate imports DeepSpeed inside save_pretrained to unwrap the model, and on a
    machine without a GPU DeepSpeed warns that it falls back to the CPU). The demo is built before a run's logs
    exist, so anything printed here would land on the user's terminal, and none of it concerns the files written.
    Both are restored after: DeepSpeed logs as usual once imported."""
    import transformers.utils.logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with deepspeed_quiet():
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


@contextmanager
def deepspeed_quiet():
    """DeepSpeed's own logger (set up at its import, writing to stdout) keeps only errors meanwhile: on a machine
    without a GPU its import warns that it falls back to the CPU, which would reach the terminal before a run's logs
    exist (a demo's save, a checkpoint's layout read before Ray starts)."""
    deepspeed_log = logging.getLogger("DeepSpeed")

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    deepspeed_log.addFilter(errors_only)
    try:
        yield
    finally:
        deepspeed_log.removeFilter(errors_only)


def demo_paths(cache_dir: Path | None = None) -> DemoPaths:
    """Where the cached demo is (or will be once ensure_demo builds it): <cache>/demo-v{DEMO_VERSION}."""
    return DemoPaths.under(_cache(cache_dir) / f"demo-v{DEMO_VERSION}")


def ensure_demo(cache_dir: Path | None = None) -> DemoPaths:
    """The cached demo at demo_paths(), built on first use. Safe to call from many processes."""
    return DemoPaths.under(cached_build(_cache(cache_dir), f"demo-v{DEMO_VERSION}", _MANIFEST, make_demo))


def _cache(cache_dir: Path | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def cached_build(cache: Path, name: str, manifest: str, build) -> Path:
    """<cache>/<name>, built by `build(folder)` on first use; complete once `manifest` is in it.

    Never returns a half-built folder: the first caller builds into a temp sibling under a file lock and renames
    it into place; the others wait at the lock, then take its folder. A cached folder is returned without the
    lock (and without importing anything heavy)."""
    final = cache / name
    if (final / manifest).is_file():  # fast path: no lock, no heavy imports
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / manifest).is_file():
            return final
        if final.exists():  # only a renamed (complete) build should ever be here
            raise RuntimeError(f"{final} exists but has no {manifest}: it was modified by hand; delete it and rerun")
        # Temp folders left by crashed builds are garbage; the age check spares a build running on another host
        # that shares this cache over a filesystem where flock does not reach.
        for stale in cache.glob(f".{name}.tmp*"):
            if time.time() - stale.stat().st_mtime > 600:
                shutil.rmtree(stale, ignore_errors=True)
        tmp = cache / f".{name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()  # not mkdtemp: its 0700 mode would stick to the final folder; this respects the umask
        try:
            build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if (final / manifest).is_file():  # lost a rename race to a process the lock did not see (another host)
                return final
            raise
    return final
