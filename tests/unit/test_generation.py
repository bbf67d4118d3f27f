"""The in-trainer rollout backend's sampler (workers/generation.py), on a tiny random Llama without DeepSpeed: each
row's own seeded stream (samples independent of the split and the batch), log-probs equal to the training forward's,
vLLM's sampling whatever the checkpoint's generation_config says, rows cut at their limit and after EOS, and the
config rules of --rollout_backend trainer."""

from types import SimpleNamespace

import pytest
import torch

from orlhf.types import SamplingSpec
from orlhf.workers import generation
from orlhf.workers.generation import Request, RowSampler, cut, uniforms

V, EOS, PAD = 48, 2, 0


@pytest.fixture(scope="module")
def worker():
    """What generation.sample reads of a DeepSpeedWorker: the model as .module and .engine, its device, no ZeRO-3."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    model = LlamaForCausalLM(cfg).eval()
    return SimpleNamespace(module=model, engine=model, device=torch.device("cpu"), zero3=False)


PROMPTS = [(0, [5, 6, 7]), (1, [8, 9, 10, 11, 12]), (2, [13]), (3, [14, 15, 16, 17])]


def test_each_rows_stream_is_its_own_and_uniform():
    seeds = torch.tensor([3, 4, 2**62 + 5], dtype=torch.long)
    draws = torch.stack([uniforms(seeds, t) for t in range(3000)])  # (T, 3)
    assert torch.equal(draws[:, 1], torch.stack([uniforms(seeds[1:2], t)[0] for t in range(3000)]))  # batch-free
    assert (draws >= 0).all() and (draws < 1).all()
    assert draws.mean(0).sub(0.5).abs().max() < 0.02  # uniform mean 1/2, std of the mean ~0.005
    assert torch.corrcoef(draws.T).sub(torch.eye(3)).abs().max() < 0.06  # neighbouring seeds are not correlated


def test_the_sampler_draws_from_the_distribution_and_records_its_log_probs():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 4000
    sampler = RowSampler(list(range(n)), "cpu")
    forced = sampler(None, probs.log().expand(n, 4).clone())
    token = forced.argmax(-1)
    assert torch.isinf(forced).sum() == n * 3  # one choice left per row
    freq = torch.bincount(token, minlength=4).float() / n
    assert freq.sub(probs).abs().max() < 0.03 and freq[3] == 0  # a zero-probability token is never drawn
    assert torch.allclose(sampler.logprobs(1)[:, 0], probs.log()[token])


def test_samples_do_not_depend_on_the_split_nor_on_the_checkpoints_generation_config(worker):
    spec = SamplingSpec(max_new_tokens=12, n=2, seed=7)
    whole = generation.rollouts(worker, PROMPTS, spec, PAD, EOS)
    halves = generation.rollouts(worker, PROMPTS[:2], spec, PAD, EOS) + generation.rollouts(
        worker, PROMPTS[2:], spec, PAD, EOS
    )
    assert [r.response_ids for r in whole] == [r.response_ids for r in halves]  # as ranks split a batch
    assert [r.prompt_index for r in whole] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert whole[0].response_ids != whole[1].response_ids  # a prompt's samples are not copies
    other = generation.rollouts(worker, PROMPTS, SamplingSpec(max_new_tokens=12, n=2, seed=8), PAD, EOS)
    assert [r.response_ids for r in other] != [r.response_ids for r in whole]
    gc = worker.module.generation_config
    saved = (gc.do_sample, gc.temperature, gc.top_k)
    gc.do_sample, gc.temperature, gc.top_k = True, 0.05, 1  # a checkpoint's own sampling defaults
    try:
        again = generation.rollouts(worker, PROMPTS, spec, PAD, EOS)
    finally:
        gc.do_sample, gc.temperature, gc.top_k = saved
    assert [r.response_ids for r in again] == [r.response_ids for r in whole]
    assert worker.module.generation_config is gc and worker.engine.training is False  # both put back


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.8, 0.9)])
def test_log_probs_are_those_of_the_distribution_sampled_from(worker, temperature, top_p):
    """At temperature 1 the training forward's log-probs; otherwise vLLM's processed ones: log-softmax of logits /
    temperature after top-p, computed here from one full forward of each whole sequence."""
    from transformers import TopPLogitsWarper

    spec = SamplingSpec(temperature=temperature, top_p=top_p, max_new_tokens=10, n=2, seed=3)
    for r in generation.rollouts(worker, PROMPTS, spec, PAD, EOS):
        seq = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = worker.module(seq).logits[0, len(r.prompt_ids) - 1 : -1].float() / temperature  # (L, V)
        if top_p < 1:
            logits = TopPLogitsWarper(top_p)(None, logits)
        want = logits.log_softmax(-1).gather(-1, torch.tensor(r.response_ids)[:, None]).squeeze(-1)
        assert len(r.logprobs) == len(r.response_ids)
        assert torch.tensor(r.logprobs).sub(want).abs().max() < 1e-5


def test_rows_are_cut_at_their_limit_then_after_the_first_eos(worker):
    assert cut([7, 7, 9, 7], [-0.1, -0.2, -0.3, -0.4], 6, [9]) == generation.Sampled(
        [7, 7, 9], [-0.1, -0.2, -0.3], True
    )
    assert cut([7, 7, 9, 7], [-0.1, -0.2, -0.3, -0.4], 2, [9]) == generation.Sampled([7, 7], [-0.1, -0.2], False)
    spec = SamplingSpec(max_new_tokens=20, max_len=8, n=1, seed=1)  # prompt 1 (5 tokens) may add 3, prompt 2 seven
    out = generation.rollouts(worker, PROMPTS, spec, PAD, EOS)
    for r in out:
        assert len(r.prompt_ids) + len(r.response_ids) <= 8
        assert r.finished == (r.response_ids[-1] == EOS) and EOS not in r.response_ids[:-1]
    few = [Request([5, 6], s, 30) for s in range(40)]  # long enough that some rows draw EOS (1/48 a token)
    assert any(s.finished for s in generation.sample(worker, few, 1.0, 1.0, PAD, EOS))


def test_the_models_eos_ids_end_a_response_too(worker):
    gc = worker.module.generation_config
    saved = gc.eos_token_id
    gc.eos_token_id = [EOS, 11]
    try:
        assert generation.eos_ids(worker.module, 40) == [EOS, 11, 40]
        assert generation.eos_ids(worker.module, None, [12]) == [EOS, 11, 12]
    finally:
        gc.eos_token_id = saved


def test_agent_turns_keep_their_order_and_refuse_what_needs_vllm(worker):
    def params(temperature, seed, **kw):
        base = dict(temperature=temperature, top_p=1.0, max_tokens=5, seed=seed, stop=None, stop_token_ids=None)
        return SimpleNamespace(**{**base, **kw})

    requests = [([5, 6], params(1.0, 1)), ([7], params(0.5, 2)), ([8, 9], params(1.0, 3))]
    out = generation.turns(worker, requests, PAD, EOS)
    alone = generation.turns(worker, requests[1:2], PAD, EOS)
    assert out[1] == alone[0]  # grouped by temperature, answered in request order
    assert all(finish in ("stop", "length") and len(ids) == len(lps) for ids, lps, finish in out)
    with pytest.raises(ValueError, match=r"sampling_params.stop = \['</s>'\]: stop strings need vLLM"):
        generation.turns(worker, [([5], params(1.0, 1, stop=["</s>"]))], PAD, EOS)
    with pytest.raises(ValueError, match="sampling_params.top_k = 5 needs vLLM engines"):
        generation.turns(worker, [([5], params(1.0, 1, top_k=5))], PAD, EOS)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"vllm_num_engines": 0, "vllm_sync_backend": "gloo"}, "--vllm_sync_backend: sets up vLLM engines"),
        ({"rollout_backend": "trainer", "async_train": True}, "--async_train overlaps generation with training"),
        ({"rollout_backend": "trainer", "vllm_num_engines": 2}, "--rollout_backend trainer generates in the actor"),
        ({"rollout_backend": "vllm", "vllm_num_engines": 0}, "--rollout_backend vllm needs --vllm_num_engines >= 1"),
        ({"vllm_num_engines": -1}, "--vllm_num_engines must be >= 0"),
    ],
)
def test_trainer_backend_rules_name_the_flags(flags, message):
    from orlhf.config.flags import build_config
    from orlhf.config.train_config import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_config({"device": "cpu", **flags}, explicit=set(flags))


def test_trainer_backend_places_no_engine():
    from orlhf.config.flags import build_config
    from orlhf.launch.bringup import run_layout

    for flags in ({"vllm_num_engines": 0}, {"rollout_backend": "trainer"}):
        cfg = build_config({"device": "cpu", **flags}, explicit=set(flags))
        assert cfg.rollout_name == "trainer" and cfg.num_engines == 0 and not cfg.engines_colocated
        assert run_layout(cfg).engines == ()
