"""Named model sizes for the benchmarks, and where vLLM overtakes HF `generate` among them.

    preset name -> folder: `demo` is the built-in demo model itself (orlhf.demo.builder.ensure_demo().model);
    every other preset is a random-init Llama (seed 0) with the demo's tokenizer, built once into
    <orlhf cache>/bench/models/llama-h<hidden>-l<layers>-... ($ORLHF_CACHE moves it) and reused after that
    build_model(out, hidden, layers, max_len, ...) -> a random Llama of any size under <out>/models (what
    ppo_throughput.py --hidden/--layers, probes/bench_padding.py --hidden and bench_train_mfu.py build)
    large_vocab_model(out, vocab, ...) -> a small random Llama with a vocabulary of `vocab` tokens (Qwen's 151,936
    by default): the demo's tokenizer with filler words added (probes/bench_large_vocab_run.py)
    crossover(rows, ratio_key) -> the smallest preset from which vLLM stays ahead of HF (bench_generation --sweep)

Sizes: the demo's vocabulary is 965 tokens, so embeddings and LM head are a small share; the decoder layers carry
the parameters. `stated_m` is the size the preset advertises (millions of parameters); `param_count` counts the
real ones (tests/unit/test_model_presets.py keeps them within 10%).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger("model_presets")


@dataclass(frozen=True)
class Preset:
    name: str
    stated_m: float  # advertised size, millions of parameters
    hidden: int = 0  # 0: the demo model itself
    layers: int = 0
    intermediate: int = 0
    heads: int = 0


# Ascending in size. mini/small/base fill the gap between the demo and medium so that a crossover can be placed;
# large (~50M) brackets it from above if medium is not yet past it.
PRESETS = {
    p.name: p
    for p in (
        Preset("demo", 0.58),  # 2 layers, hidden 128, intermediate 256, 4 heads (orlhf/demo/builder.py)
        Preset("mini", 1.7, hidden=192, layers=3, intermediate=512, heads=3),
        Preset("small", 3.7, hidden=256, layers=4, intermediate=704, heads=4),
        Preset("base", 7.8, hidden=384, layers=4, intermediate=1024, heads=6),
        Preset("medium", 20.3, hidden=512, layers=6, intermediate=1408, heads=8),
        Preset("large", 51.0, hidden=768, layers=7, intermediate=2048, heads=12),
    )
}


def bench_cache() -> Path:
    from orlhf.demo.builder import default_cache_dir

    return default_cache_dir() / "bench"


def _llama_config(tok, hidden: int, layers: int, intermediate: int, heads: int, max_pos: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )


def _save_random_llama(path: Path, cfg, tok, init_device: str = "cpu") -> None:
    """Random init (seed 0) -> <path>, written to a temporary folder first so that a crash or a second process
    building the same model never leaves a half-written folder behind. `init_device` "cuda": initialized on the GPU
    (seconds instead of minutes for a billion parameters; other random values than a CPU build, same shapes)."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar: terminal noise in a benchmark's table
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device(init_device):
        model = LlamaForCausalLM(cfg)
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished the same model first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "config.json").exists():
            raise
    log.info("built %s: %.1fM params", path, sum(p.numel() for p in model.parameters()) / 1e6)


def build_model(
    out: Path,
    hidden: int,
    layers: int,
    max_len: int,
    intermediate: Optional[int] = None,
    heads: Optional[int] = None,
    init_device: str = "cpu",
) -> Path:
    """A random Llama of the given size with the demo's tokenizer, cached under <out>/models. Intermediate size
    and heads default to 2 x hidden and one head per 32 (hidden <= 256) or 64 dimensions. `init_device`: where a
    model not yet cached is initialized (_save_random_llama)."""
    from transformers import AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    default_heads = max(1, hidden // (32 if hidden <= 256 else 64))
    inter, nheads, max_pos = intermediate or 2 * hidden, heads or default_heads, max(512, max_len)
    name = f"llama-h{hidden}-l{layers}"  # the name earlier runs cached the default shapes under
    name += "".join(
        f"-{k}{v}"
        for k, v, dflt in (("i", inter, 2 * hidden), ("a", nheads, default_heads), ("p", max_pos, 512))
        if v != dflt
    )
    path = Path(out) / "models" / name
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = AutoTokenizer.from_pretrained(ensure_demo().model)
        _save_random_llama(path, _llama_config(tok, hidden, layers, inter, nheads, max_pos), tok, init_device)
    return path


QWEN_VOCAB = 151_936  # Qwen2/2.5/3's vocabulary (embedding rows), what large-vocabulary runs are sized on


def filler_tokenizer(folder: Path, vocab: int):
    """The demo's tokenizer grown to `vocab` ids: the ids past its own are filler words "Ġ<fillerN>" (a leading
    space in the byte-level alphabet, so a sampled filler decodes to " <fillerN>", one more word that is not a
    color) in the BPE vocabulary without merges: encoding never produces them, so the demo's prompts encode as
    before, and any id a model samples decodes. Saved into `folder`; returns the loaded tokenizer."""
    from transformers import AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo().model
    spec = json.loads((demo / "tokenizer.json").read_text())
    table = spec["model"]["vocab"]
    taken = set(table.values()) | {t["id"] for t in spec["added_tokens"]}
    if len(taken) > vocab:
        raise ValueError(f"the demo's tokenizer has {len(taken)} ids already, more than the {vocab} asked for")
    for i in (i for i in range(vocab) if i not in taken):
        table[f"Ġ<filler{i}>"] = i
    folder.mkdir(parents=True, exist_ok=True)
    for f in demo.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copyfile(f, folder / f.name)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    tok = AutoTokenizer.from_pretrained(folder)
    if len(tok) != vocab:
        raise ValueError(f"{folder}: the grown tokenizer has {len(tok)} ids, not {vocab}")
    return tok


def large_vocab_model(out: Path, vocab: int = QWEN_VOCAB, hidden: int = 64, layers: int = 2, max_len: int = 1024):
    """A random Llama with a `vocab`-token vocabulary (filler_tokenizer) and a small body, cached under
    <out>/models: where the LM head and the logits, not the decoder, set a run's memory. Hidden 64, 2 layers and
    Qwen's vocabulary: ~19.5M parameters, 19.4M of them embeddings and LM head."""
    heads = max(1, hidden // (32 if hidden <= 256 else 64))
    max_pos = max(512, max_len)
    path = Path(out) / "models" / f"llama-h{hidden}-l{layers}-v{vocab}-p{max_pos}"
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tok = filler_tokenizer(path.parent / f".{path.name}.tok{os.getpid()}", vocab)
        try:
            _save_random_llama(path, _llama_config(tok, hidden, layers, 2 * hidden, heads, max_pos), tok)
        finally:
            shutil.rmtree(path.parent / f".{path.name}.tok{os.getpid()}", ignore_errors=True)
    return path


def preset_model(name: str, cache: Optional[Path] = None, max_len: int = 512) -> Path:
    """The folder of preset `name` (built on first use). `max_len`: prompt + response tokens the caller needs."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[name]
    if not p.hidden:
        from orlhf.demo.builder import ensure_demo

        return ensure_demo().model
    return build_model(
        Path(cache) if cache else bench_cache(), p.hidden, p.layers, max_len, intermediate=p.intermediate, heads=p.heads
    )


def parse_presets(spec: str) -> list[str]:
    """'demo,medium' -> ['demo', 'medium']; 'all' -> every preset. SystemExit naming the bad names."""
    names = list(PRESETS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in PRESETS]
    if bad or not names:
        raise SystemExit(f"model presets {bad or spec!r}: unknown; choose from {', '.join(PRESETS)} (or 'all')")
    return names


def param_count(folder: Path) -> int:
    """Parameters of the model in `folder`, counted on the meta device from its config (nothing is loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def preset_params(name: str) -> int:
    """Parameters of preset `name` without building it (the demo's from its folder)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from orlhf.demo.builder import ensure_demo

    p = PRESETS[name]
    if not p.hidden:
        return param_count(ensure_demo().model)
    tok = AutoTokenizer.from_pretrained(ensure_demo().model)
    with torch.device("meta"):
        model = LlamaForCausalLM(_llama_config(tok, p.hidden, p.layers, p.intermediate, p.heads, 512))
    return sum(x.numel() for x in model.parameters())


def crossover(rows: list[dict], ratio_key: str) -> Optional[str]:
    """The smallest model (by rows' "params") from which vLLM stays ahead: ratio_key (HF time / vLLM time) > 1 at
    it and at every larger model tried. None: vLLM is not ahead at the largest model tried. A size where vLLM
    wins but a larger one where it loses again does not count (noise, not a crossover)."""
    ordered = sorted(rows, key=lambda r: r["params"])
    found = None
    for r in reversed(ordered):
        if r[ratio_key] <= 1.0:
            break
        found = r["preset"]
    return found


def describe_crossover(rows: list[dict], ratio_key: str) -> str:
    name = crossover(rows, ratio_key)
    ordered = sorted(rows, key=lambda r: r["params"])
    if name is None:
        return f"not within the sizes tried (HF still ahead at {ordered[-1]['preset']})"
    if name == ordered[0]["preset"]:
        return f"at or below {name} ({ordered[0]['params'] / 1e6:.1f}M params: vLLM ahead at every size tried)"
    below = ordered[[r["preset"] for r in ordered].index(name) - 1]
    at = next(r for r in ordered if r["preset"] == name)
    return (
        f"between {below['preset']} ({below['params'] / 1e6:.1f}M, {below[ratio_key]:.2f}x) and {name} "
        f"({at['params'] / 1e6:.1f}M, {at[ratio_key]:.2f}x)"
    )


if __name__ == "__main__":  # list the presets with their real sizes (builds nothing)
    logging.basicConfig(level=logging.INFO)
    for n, pr in PRESETS.items():
        print(
            json.dumps(
                {
                    "preset": n,
                    "stated_m": pr.stated_m,
                    "params": preset_params(n),
                    "hidden": pr.hidden,
                    "layers": pr.layers,
                    "intermediate": pr.intermediate,
                    "heads": pr.heads,
                }
            )
        )
