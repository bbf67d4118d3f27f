"""orlhf/algo/logprobs.py: the hand-written backward gives autograd's values and gradients bit for bit."""

import pytest
import torch

from orlhf.algo.logprobs import token_log_probs


def _reference(logits, tokens, offset, temperature):
    """What policy.py computed before: slice, divide, gather - logsumexp, all through autograd."""
    x = logits[:, offset : offset + tokens.shape[1]].float() / temperature
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize(
    "shape,offset,temperature",
    [
        ((64, 25, 965), 0, 1.0),  # the demo: logits_to_keep = A + 1, window = all but the last position
        ((64, 24, 965), 0, 1.0),  # the packed path: logits already (B, A, V)
        ((3, 11, 50), 4, 0.7),  # window in the middle, temperature
        ((1, 2, 7), 0, 1.3),
    ],
)
def test_values_and_gradients_bit_identical_to_autograd(shape, offset, temperature):
    b, l, v = shape  # noqa: E741 (batch, length, vocabulary)
    a = min(l - offset, 24) if l - offset > 1 else 1
    a = a - 1 if offset + a == l and l > a else a  # leave a position outside the window where there is room
    g = torch.Generator().manual_seed(sum(shape))
    base = torch.randn(*shape, generator=g) * 4
    tokens = torch.randint(0, v, (b, a), generator=g)
    upstream = torch.randn(b, a, generator=g) * (torch.rand(b, a, generator=g) > 0.3)  # masked rows give 0 grads

    ref_in = base.clone().requires_grad_(True)
    ref = _reference(ref_in, tokens, offset, temperature)
    ref.backward(upstream)

    got_in = base.clone().requires_grad_(True)
    got = token_log_probs(got_in, tokens, offset, temperature)
    got.backward(upstream)

    assert torch.equal(got, ref)
    assert torch.equal(got_in.grad, ref_in.grad)


def test_no_grad_path_matches():
    logits = torch.randn(4, 6, 30)
    tokens = torch.randint(0, 30, (4, 5))
    with torch.no_grad():
        assert torch.equal(token_log_probs(logits, tokens, 0, 1.0), _reference(logits, tokens, 0, 1.0))
        assert torch.equal(token_log_probs(logits, tokens, 1, 0.5), _reference(logits, tokens, 1, 0.5))


def test_is_a_log_softmax():
    logits = torch.randn(2, 3, 10)
    tokens = torch.randint(0, 10, (2, 3))
    want = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_log_probs(logits, tokens), want)


@pytest.mark.parametrize("offset,temperature", [(0, 1.0), (2, 0.7)])
def test_entropy_comes_with_the_same_log_probs_and_gradients(offset, temperature):
    from orlhf.algo.logprobs import token_log_probs_entropy
    from orlhf.algo.losses import entropy_from_logits

    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 9, 40, generator=g) * 3
    tokens = torch.randint(0, 40, (6, 5), generator=g)
    upstream = torch.randn(6, 5, generator=g)
    plain_in, with_in = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    plain = token_log_probs(plain_in, tokens, offset, temperature)
    got, entropy = token_log_probs_entropy(with_in, tokens, offset, temperature)
    plain.backward(upstream)
    got.backward(upstream)
    assert torch.equal(got, plain) and torch.equal(with_in.grad, plain_in.grad)  # bit for bit
    assert not entropy.requires_grad
    # the entropy of the same window as the loss's entropy term computes it (float rounding apart)
    want = entropy_from_logits(base[:, offset : offset + 5] / temperature)
    torch.testing.assert_close(entropy, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        lp, ent = token_log_probs_entropy(base, tokens, offset, temperature)
    assert torch.equal(lp, plain.detach()) and torch.allclose(ent, entropy, rtol=1e-6, atol=1e-7)
