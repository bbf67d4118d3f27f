"""EngineActor's reading of a completion's log-probs: vLLM's FlatLogprobs (what orlhf asks for) and its list of
{token id: Logprob} dicts give the same sampled-token floats, 0.0 where a position has none."""

from orlhf.rollout.engine import sampled_logprobs


def test_flat_and_dict_logprobs_give_the_same_floats():
    from vllm.logprobs import FlatLogprobs, Logprob

    positions = [
        {7: Logprob(-0.25, rank=2)},
        {3: Logprob(-1.5, rank=1), 9: Logprob(-0.1, rank=1)},
        {},
        {4: Logprob(-3.0)},
    ]
    flat = FlatLogprobs()
    for p in positions:
        flat.append(p)
    assert sampled_logprobs(flat) == [-0.25, -1.5, 0.0, -3.0]  # the first entry is the sampled token's
    assert sampled_logprobs(positions) == [-0.25, -1.5, 0.0, -3.0]
    assert sampled_logprobs(None) == [] and sampled_logprobs(FlatLogprobs()) == []
