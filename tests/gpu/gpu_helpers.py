"""Helpers of the one-GPU tests: a tiny local Llama, a batch with padding, the report of measured figures."""

import importlib.metadata
import json
import os
from pathlib import Path

import torch

B, P, A, V = 8, 6, 5, 128  # batch, prompt length, response length, vocab
PAD = 0


def tiny_llama(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> str:
    """A random-weight Llama with a word-level tokenizer, saved as an HF folder (what every loader reads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=V,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, V)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)
    return str(path)


def padded_batch(seed: int = 123):
    """Left-padded prompts (1..P real tokens), right-padded responses (1..A real tokens)."""
    from orlhf.types import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(4, V, (B, P + A), generator=g)
    attn = torch.ones(B, P + A, dtype=torch.long)
    for i in range(B):
        attn[i, : i % P] = 0
        attn[i, P + 1 + (i * 3) % A :] = 0
    seq[attn == 0] = PAD
    return SequenceBatch(seq, attn, attn[:, -A:].bool())


def gpu_report(name: str, record: dict) -> None:
    """Append a measured figure to $ORLHF_GPU_REPORT (JSON lines), which gpu_check.sh prints at the end."""
    out = os.environ.get("ORLHF_GPU_REPORT")
    line = json.dumps({"test": name, **record})
    print(line)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


# ---- whole `orlhf train-ppo` runs (test_cli_gpu.py) ----------------------------------------------------------


def terminal_lines(text: str) -> tuple[list[str], list[str]]:
    """(lines besides the progress bar, bar frames): tests/e2e/test_terminal.py's split. tqdm redraws its bar
    after a carriage return."""
    other, bar = [], []
    for line in text.split("\n"):
        for seg in line.split("\r"):
            if seg.strip():
                (bar if seg.startswith("ppo:") else other).append(seg)
    return other, bar


class GpuMemoryPoller:
    """The most memory nvidia-smi reports in use on GPU 0 while the `with` block runs (MiB, every process on the
    GPU: the ranks are Ray workers, out of this process's reach). None where nvidia-smi is absent (CPU runs)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib = interval_s, None

    def _read(self):
        import subprocess

        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            return float(out.strip().splitlines()[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            used = self._read()
            if used is not None:
                self.peak_mib = max(self.peak_mib or 0.0, used)

    def __enter__(self):
        import shutil
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True) if shutil.which("nvidia-smi") else None
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()


def plan_gib(text: str) -> dict[str, float]:
    """{pool: GiB needed per GPU} from `orlhf plan`'s "per GPU" table (launch/plan.py's _device_sums)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("per GPU")), None)
    if start is None:
        return {}
    out = {}
    for line in lines[start + 2 :]:  # past the title and the table's header
        cells = line.split()
        if len(cells) < 4:
            break
        try:
            out[cells[0]] = float(cells[1])
        except ValueError:
            break
    return out


def installed(dist: str) -> bool:
    """By the installed distribution, not importlib.util.find_spec: tests/ is on pytest's sys.path, so where Ray
    is absent find_spec("ray") finds the tests/ray folder as a namespace package (seen on the GPU machine)."""
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False
