"""Padding removal (orlhf/workers/batching.py): trimmed and packed batches give the same model outputs as padded
ones."""

import pytest
import torch

from orlhf.types import Experience, SequenceBatch
from orlhf.workers.batching import pack, pad_actions, real_lengths, sort_by_length, trim
from orlhf.workers.causal_lm import action_logits, gather_log_probs

PAD, V = 0, 64


def _batch(prompt_lens, response_lens, P=7, A=6, seed=0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    seq = torch.randint(4, V, (B, P + A), generator=g)
    attn = torch.zeros(B, P + A, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        attn[i, P - p : P + r] = 1
    seq[attn == 0] = PAD
    return SequenceBatch(seq, attn, attn[:, -A:].bool())


def test_trim_drops_only_columns_that_are_padding_in_every_row():
    b = _batch([2, 3], [1, 4])  # P=7, A=6: 4 unused prompt columns, 2 unused action columns
    t = trim(b)
    assert t.sequences.shape == (2, 3 + 4) and t.num_actions == 4
    assert torch.equal(t.sequences[t.attention_mask.bool()], b.sequences[b.attention_mask.bool()])
    assert real_lengths(t)[0].tolist() == [2, 3] and real_lengths(t)[1].tolist() == [1, 4]


def test_trim_slices_every_action_field_of_an_experience_and_keeps_full_batches():
    b = _batch([7, 2], [6, 1])
    assert trim(b) is b  # nothing to drop
    b = _batch([1, 2], [2, 1])
    adv = torch.arange(12.0).view(2, 6)
    exp = Experience(
        b.sequences,
        b.attention_mask,
        b.action_mask,
        action_log_probs=-adv,
        advantages=adv,
        returns=None,
        values=adv * 2,
        weight_version=3,
    )
    t = trim(exp)
    assert t.sequences.shape == (2, 2 + 2) and t.advantages.tolist() == [[0, 1], [6, 7]]
    assert t.values.shape == (2, 2) and t.returns is None and t.weight_version == 3
    assert (
        torch.equal(pad_actions(t.advantages, 6)[:, :2], adv[:, :2]) and pad_actions(t.advantages, 6)[:, 2:].eq(0).all()
    )


def test_trim_keeps_one_prompt_and_one_action_column():
    b = _batch([1], [0])
    t = trim(b)
    assert t.num_actions == 1 and t.sequences.shape[1] - t.num_actions == 1


def test_sort_by_length_is_a_stable_permutation():
    b = _batch([3, 1, 3, 2], [2, 1, 2, 6])
    assert sort_by_length(b).tolist() == [1, 0, 2, 3]


def test_pack_indices():
    b = _batch([2, 3], [1, 2], P=4, A=3)
    p = pack(b)
    assert p.input_ids.shape == (1, 3 + 5)
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.score_index.tolist() == [1, 5, 6]  # the token before each action
    assert p.last_index.tolist() == [2, 7]
    out = p.unflatten(torch.tensor([1.0, 2.0, 3.0]))
    assert out.tolist() == [[1, 0, 0], [2, 3, 0]]
    with pytest.raises(ValueError, match="prompt token"):
        pack(_batch([0], [2]))


@pytest.fixture(scope="module")
def lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("how", ["trim", "pack"])
def test_trimmed_and_packed_log_probs_equal_the_padded_ones(lm, how):
    b = _batch([7, 2, 4, 1, 5], [6, 1, 3, 2, 4])
    with torch.no_grad():
        padded = gather_log_probs(action_logits(lm, b, 1.0), b.sequences[:, -b.num_actions :])
        if how == "trim":
            t = trim(b.index(torch.tensor([1, 2, 3])))  # longest prompt 4, response 3
            assert t.sequences.shape[1] == 4 + 3
            got = gather_log_probs(action_logits(lm, t, 1.0), t.sequences[:, -t.num_actions :])
            want = padded[1:4, : t.num_actions]
        else:
            got = gather_log_probs(action_logits(lm, b, 1.0, packed=True), b.sequences[:, -b.num_actions :])
            want = padded
    mask = b.action_mask[1:4, : got.shape[1]] if how == "trim" else b.action_mask
    assert (got - want)[mask].abs().max() < 1e-5
