"""benchmarks/probes/flop_profile.py's counting: the body's matrix weights of a real config, the positions of orlhf's
shared-prompt layout (common head, remainders, responses) and of TRL's padded rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
import flop_profile  # noqa: E402


def test_the_body_counts_every_decoder_matrix():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=50, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    matrices = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    shape = flop_profile.Shape.of(cfg)
    assert shape.body == matrices and shape.vocab == 50 and shape.layers == 3
    # one position, no context, not scored: 2 FLOPs per weight; scored: plus the LM head's
    assert shape.forward(1, 0, 0) == 2 * matrices
    assert shape.forward(1, 0, 1) == 2 * matrices + 2 * 50 * 64


def test_layouts_count_the_head_once_per_micro_batch_and_trl_every_padded_row():
    head = [1, 2, 3, 4]
    prompts = [head + [5], head + [6, 7], head + [8, 9, 10], head + [11]]  # lengths 5, 6, 7, 5
    assert flop_profile.common_head(prompts) == 4
    # 2 samples a prompt, micro-batches of 4 rows: 2 prompts each; the longest response at the limit, 4 tokens
    out = flop_profile.orlhf_layout(prompts, samples=2, micro=4, resp=3, limit=4)
    # first micro-batch: head 4, remainders 1 and 2 but the last column -> 0 and 1, padded to 1: 2; 4 rows x 4
    # second: head 4, remainders 3 -> 2 and 0, padded to 2: 4; 4 rows x 4
    assert out == {"positions": (4 + 2 + 16) + (4 + 4 + 16), "scored": 32}
    trl = flop_profile.trl_layout(prompts, samples=2, resp=3, limit=4)
    assert trl == {"positions": 8 * (7 + 4), "scored": 32, "prompt_cols": 7}
