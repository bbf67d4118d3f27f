"""Helpers of the one-GPU tests: a tiny local Llama, a batch with padding, the report of measured figures."""

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
