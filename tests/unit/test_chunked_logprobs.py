"""Log-probs and entropy a chunk of tokens at a time (algo/chunked_logprobs.py) equal the whole-logits path: values to
1e-6 and gradients (of the hidden states and the LM head, through the log-probs and through the entropy) to 1e-5
in float32, at temperature 1 and below, for any chunk size; a chunk of the vocabulary-sized logits is all it holds."""

import pytest
import torch

from orlhf.algo.chunked_logprobs import chunk_rows, chunked_log_probs_entropy

N, H, V = 10, 16, 50


def whole(hidden, weight, tokens, temperature):
    """The plain path: the LM head's logits, then log-softmax and entropy over the whole vocabulary."""
    x = (hidden @ weight.t()).float() / temperature
    log_p = x.log_softmax(-1)
    return log_p.gather(-1, tokens[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 10, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_whole_logits_path(rows, temperature):
    g = torch.Generator().manual_seed(0)
    hidden = (0.3 * torch.randn(2, N // 2, H, generator=g)).requires_grad_()  # log-probs of a few nats, as a LM's
    weight = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    tokens = torch.randint(0, V, (2, N // 2), generator=g)
    a, b = torch.randn(2, N // 2, generator=g), torch.randn(2, N // 2, generator=g)  # upstream gradients

    lp_ref, ent_ref = whole(hidden, weight, tokens, temperature)
    gh_ref, gw_ref = torch.autograd.grad((lp_ref * a).sum() + (ent_ref * b).sum(), (hidden, weight), retain_graph=True)
    lp, ent = chunked_log_probs_entropy(hidden, weight, tokens, temperature, rows)
    gh, gw = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), (hidden, weight), retain_graph=True)

    assert (lp - lp_ref).abs().max() < 1e-6 and (ent - ent_ref).abs().max() < 1e-6
    assert (gh - gh_ref).abs().max() < 1e-5 and (gw - gw_ref).abs().max() < 1e-5
    # through the log-probs alone (entropy only logged): the entropy's gradient is not taken
    gh2, gw2 = torch.autograd.grad((lp * a).sum(), (hidden, weight))
    gh2_ref, gw2_ref = torch.autograd.grad((lp_ref * a).sum(), (hidden, weight))
    assert (gh2 - gh2_ref).abs().max() < 1e-5 and (gw2 - gw2_ref).abs().max() < 1e-5
    # a scoring forward asks for no entropy: the same log-probs and gradients, the entropy left at 0
    lp3, ent3 = chunked_log_probs_entropy(hidden, weight, tokens, temperature, rows, entropy=False)
    gh3, gw3 = torch.autograd.grad((lp3 * a).sum(), (hidden, weight))
    assert torch.equal(lp3, lp) and not ent3.any() and torch.equal(gh3, gh2) and torch.equal(gw3, gw2)


def test_bf16_weights_give_float32_results_within_bf16_rounding():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, H, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(V, H, generator=g).bfloat16().requires_grad_()
    tokens = torch.randint(0, V, (N,), generator=g)
    lp, ent = chunked_log_probs_entropy(hidden, weight, tokens, 1.0, 4)
    lp_ref, ent_ref = whole(hidden, weight, tokens, 1.0)
    assert lp.dtype == torch.float32 and (lp - lp_ref).abs().max() < 1e-5
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def test_rows_per_chunk_follow_the_memory_budget():
    assert chunk_rows(151_936, 256) == 441  # 256 MiB of float32 logits of a 152k vocabulary
    assert chunk_rows(1_000, 256) == 67_108  # the demo's: every micro-batch in one chunk
    assert chunk_rows(10**9, 1) == 1


# ---- through a real causal LM: every forward path (plain, each prompt once, packed) ---------------------------------


def _llama(vocab: int, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    return LlamaForCausalLM(cfg)


def _batch(vocab: int):
    from orlhf.types import SequenceBatch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[2:, :2] = 0  # rows 2, 3: a prompt 2 tokens shorter (left padding)
    ids[1, :6] = ids[0, :6]  # rows 0, 1 share a prompt (6 columns); rows 2, 3 another
    ids[3, :6] = ids[2, :6]
    mask[3, 11] = 0  # one response ends a token early
    return SequenceBatch(ids, mask, mask[:, 6:].bool())


@pytest.mark.parametrize("path", ["plain", "shared", "packed"])
def test_a_models_log_probs_entropy_and_gradients_equal_the_whole_logits(path):
    from orlhf.workers.causal_lm import action_log_probs_entropy, chunked_action_log_probs

    model, batch = _llama(300), _batch(300)
    how = dict(packed=path == "packed", shared=path == "shared")
    real = batch.action_mask
    lp_ref, ent_ref = action_log_probs_entropy(model, batch, 0.8, **how)
    (lp_ref[real].sum()).backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    budget = 300 * 4 * 5 / 2**20  # 5 tokens of float32 logits a chunk: 24 action tokens in 5 chunks
    lp, ent = chunked_action_log_probs(model, batch, 0.8, chunk_mb=budget, **how)
    assert ent.requires_grad  # in the graph, for an --entropy_loss_coef term
    (lp[real].sum()).backward()
    assert (lp - lp_ref)[real].abs().max() < 1e-6
    assert ((ent - ent_ref) / ent_ref)[real].abs().max() < 1e-6  # ~5.7 nats: a few float32 ulps, summed in chunks
    for n, p in model.named_parameters():
        assert (p.grad - grads_ref[n]).abs().max() < 1e-5, n
    assert "forward" not in model.lm_head.__dict__  # the head is itself again


def test_the_whole_logits_stay_where_chunks_would_not_save_memory_or_the_model_changes_them():
    from orlhf.workers.lm_head import chunked_head

    model = _llama(300)
    assert chunked_head(model, 24, 256) is None  # the micro-batch's logits fit in one chunk
    assert chunked_head(model, 24, 0) is None  # --logprobs_chunk_mb 0
    assert chunked_head(model, 24, 300 * 4 * 5 / 2**20) == (model.lm_head, 5)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's soft-capping after the head
    assert chunked_head(model, 24, 300 * 4 * 5 / 2**20) is None


# ---- memory: one chunk's buffer, not several ------------------------------------------------------------------------

_PEAK_SCRIPT = """
import sys
from pathlib import Path

import torch

from orlhf.algo.chunked_logprobs import chunked_log_probs_entropy


def rss(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) * 1024


torch.manual_seed(0)
V, H, N, rows = 131072, 16, 256, 128  # a chunk: 128 rows of float32 logits, 64 MiB; 2 chunks
hidden, weight = torch.randn(N, H).requires_grad_(), (0.1 * torch.randn(V, H)).requires_grad_()
tokens = torch.randint(0, V, (N,))
peaks = []
for _ in range(2):  # the second round: what the first left in the heap is reused, not counted
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss("VmRSS")
    lp, ent = chunked_log_probs_entropy(hidden, weight, tokens, 0.9, rows)
    peaks.append(rss("VmHWM") - before)
    Path("/proc/self/clear_refs").write_text("5")
    before = rss("VmRSS")
    (lp.sum() + ent.sum()).backward()
    peaks.append(rss("VmHWM") - before)
    hidden.grad = weight.grad = None
print(max(peaks[2:]) / 2**20)
"""


def test_a_chunk_holds_one_buffer_of_its_logits_not_several():
    """The forward (entropy included) and the backward hold one (C, V) float32 buffer, reused by every chunk, and
    slices of one: under 1.5 chunks above the RSS before them (several whole chunks at once before)."""
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, cwd=root, check=True, timeout=300
    )
    peak_mib = float(out.stdout.strip().splitlines()[-1])
    assert peak_mib < 1.5 * 64, f"chunked log-probs peaked {peak_mib:.0f} MiB above their start: chunks of 64 MiB"
