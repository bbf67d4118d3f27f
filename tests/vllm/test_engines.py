"""vLLM engines on CPU with real weight sync from a 2-rank ZeRO-3 actor (one set of engines per module).

actor (2 ranks, ZeRO-3) --train_step--> --WeightSync (gloo | ray.util.collective)--> 2 engines: log-probs == trainer's
"""

import dataclasses
import os
import time

import pytest
import torch

from orlhf.config.resolve import finish_config
from orlhf.config.worker_config import worker_config
from orlhf.cpu.tuning import CpuTuning
from orlhf.distributed.groups import ActorGroup, RankError
from orlhf.distributed.placement import EngineBundles, create_placement_groups, remove_placement_groups
from orlhf.launch.bringup import run_layout
from orlhf.rollout.engine import EngineActor, SamplingSpec
from orlhf.rollout.engine_config import engine_config
from orlhf.rollout.engine_group import EngineGroup
from orlhf.rollout.weight_sync import WeightSync
from orlhf.trainer.experience import rollouts_to_batch
from orlhf.types import Experience
from orlhf.workers import PolicyWorker

pytestmark = [pytest.mark.ray, pytest.mark.vllm]
N_PROMPTS = 6


@pytest.fixture(scope="module")
def rig():
    import ray

    from tests.conftest import TEST_CLUSTER_CPUS

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=TEST_CLUSTER_CPUS, include_dashboard=False)
    flags = {
        "train_batch_size": 8,
        "micro_train_batch_size": 2,
        "rollout_batch_size": 8,
        "actor_num_gpus_per_node": 2,
        "vllm_num_engines": 2,  # KV cache sized automatically (cpu/engine_kv.py)
        "vllm_cpu_threads": 2,
        "advantage_estimator": "reinforce",
        "device": "cpu",
    }
    cfg = finish_config(flags, explicit=set(flags))
    placed = create_placement_groups(run_layout(cfg), timeout_s=60)
    t0 = time.monotonic()
    tuning = CpuTuning.for_config(cfg)
    engines = EngineGroup(
        engine_config(cfg), [placed.engine_bundles(i) for i in range(2)], timeout_s=300, tuning=tuning
    )
    actor = ActorGroup(
        "actor",
        PolicyWorker,
        worker_config(cfg, "actor", 4),
        placed.role_bundles("actor"),
        device="cpu",
        gpus_per_node=2,
        timeout_s=300,
    )
    actor.call(PolicyWorker.init).get()
    sync = WeightSync(actor, engines, backend="gloo", timeout_s=120)
    print(f"\n[engines] 2 engines + 2 actor ranks + sync group ready in {time.monotonic() - t0:.1f} s")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.data.pretrain)
    yield cfg, engines, actor, sync, tok
    engines.shutdown()
    actor.shutdown()
    remove_placement_groups(placed)


def prompts(tok, n=N_PROMPTS):
    return [tok(f"say colors: red {'blue ' * i}cat")["input_ids"] for i in range(n)]


def test_generation_order_shapes_and_masks(rig):
    cfg, engines, _, _, tok = rig
    ps = prompts(tok)
    out = engines.generate(ps, SamplingSpec(max_new_tokens=8, n=2, seed=3))
    assert [r.prompt_index for r in out] == [i for i in range(N_PROMPTS) for _ in range(2)]
    assert {r.engine for r in out} == {0, 1}  # both engines took a share
    for r in out:
        assert r.prompt_ids == ps[r.prompt_index]
        assert 1 <= len(r.response_ids) <= 8 and len(r.logprobs) == len(r.response_ids)
        assert all(lp <= 0 for lp in r.logprobs)
    batch, lps = rollouts_to_batch(out, tok.pad_token_id)
    lens = torch.tensor([len(r.response_ids) for r in out])
    assert batch.action_mask.sum(1).tolist() == lens.tolist()
    assert (lps[~batch.action_mask] == 0).all()
    again = engines.generate(ps, SamplingSpec(max_new_tokens=8, n=2, seed=3))
    assert [r.response_ids for r in again] == [r.response_ids for r in out]  # per-request seeds


def test_automatic_kv_cache_samples_as_a_fixed_gib(rig):
    """The automatic KV cache (~64 MiB here) gives the same tokens and log-probs as a fixed 1 GiB cache:
    both hold all 256 sequences vLLM may run at once, so the scheduler never preempts with either."""
    import ray

    from orlhf.rollout.engine import RemoteEngine

    cfg, engines, _, _, tok = rig
    old = RemoteEngine.options(num_cpus=0, max_restarts=0).remote(
        dataclasses.replace(engines.cfg, kv_cache_gb=1.0), 0, tuning=engines.tuning
    )
    try:
        indexed = list(enumerate(prompts(tok, 8)))
        spec = SamplingSpec(max_new_tokens=16, n=4, seed=11)
        want = ray.get(old.generate.remote(indexed, spec), timeout=300)
        got = engines.call_rank(0, EngineActor.generate, indexed, spec).get()[0]
    finally:
        ray.kill(old, no_restart=True)
    assert len(got) == 32 and [r.response_ids for r in got] == [r.response_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]


def test_a_prompts_samples_share_its_blocks_and_sample_as_if_computed_apart(rig):
    """CPU engines cache a prompt's full blocks (cpu/engine_kv.py): the prompt's other samples, scheduled in the
    same step, read them instead of computing them, and sample bit for bit as an engine that computes every
    sample's prompt (fp32)."""
    import ray

    from orlhf.cpu.engine_kv import BLOCK_TOKENS
    from orlhf.rollout.engine import RemoteEngine

    _, engines, _, _, tok = rig
    assert engines.cfg.share_prompts
    apart = RemoteEngine.options(num_cpus=0, max_restarts=0).remote(
        dataclasses.replace(engines.cfg, share_prompts=False), 0, tuning=engines.tuning
    )
    long = [tok(f"list {i}: " + "red green blue " * (12 + 3 * i))["input_ids"] for i in range(3)]
    indexed, spec = list(enumerate(long)), SamplingSpec(max_new_tokens=8, n=4, seed=5)
    try:
        want = ray.get(apart.generate.remote(indexed, spec), timeout=300)
        assert ray.get(apart.cached_prompt_tokens.remote(), timeout=60) == 0
        before = engines.call_rank(0, EngineActor.cached_prompt_tokens).get()[0]
        got = engines.call_rank(0, EngineActor.generate, indexed, spec).get()[0]
        cached = engines.call_rank(0, EngineActor.cached_prompt_tokens).get()[0] - before
    finally:
        ray.kill(apart, no_restart=True)
    # a request's other samples read its full blocks (the last prompt token is always computed); vLLM reports
    # one count per request, a reading sample's
    assert cached == sum((len(p) - 1) // BLOCK_TOKENS * BLOCK_TOKENS for p in long) > 0
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]


def test_engines_run_the_threads_asked_for(rig):
    _, engines, _, _, _ = rig
    assert engines.call(EngineActor.num_threads).get() == [2, 2]  # --vllm_cpu_threads 2 (Ray alone would give 1 each)


def test_sync_after_train_step_gives_trainer_log_probs(rig, tmp_path):
    cfg, engines, actor, sync, tok = rig
    rollouts = engines.generate(prompts(tok, 8), SamplingSpec(max_new_tokens=6, seed=1))
    batch, _ = rollouts_to_batch(rollouts, tok.pad_token_id)
    old = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
    adv = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(0))
    actor.call_sharded(
        PolicyWorker.train_step,
        Experience(batch.sequences, batch.attention_mask, batch.action_mask, action_log_probs=old, advantages=adv),
    ).get()
    new = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
    assert (new - old)[batch.action_mask].abs().max() > 1e-4, "the train step did not move the policy"

    seconds = sync.sync(version=1)
    assert engines.call(EngineActor.set_weight_version, 1).get() == [None, None]
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    for engine_lp in engines.call(EngineActor.sequence_logprobs, seqs).get(timeout_s=120):
        for i, r in enumerate(rollouts):
            n = len(r.response_ids)
            got = torch.tensor(engine_lp[i][-n:])
            assert (got - new[i, :n]).abs().max() <= 1e-3, (i, got, new[i, :n])
    print(f"\n[sync] {seconds:.3f} s for the demo model into 2 engines")

    # Greedy output equals a fresh engine loaded from the trainer's exported weights.
    export = tmp_path / "export"
    actor.call(PolicyWorker.save_hf, str(export)).get()

    fresh = EngineGroup(
        dataclasses.replace(engine_config(cfg), model_path=str(export)),
        [EngineBundles(None, [0], 0.0)],
        timeout_s=300,
        tuning=engines.tuning,
    )
    try:
        greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
        ps = prompts(tok)
        want = [r.response_ids for r in fresh.generate(ps, greedy)]
        got = [r.response_ids for r in engines.generate(ps, greedy)]
        assert got == want
    finally:
        fresh.shutdown()


def test_sync_through_ray_collective_gives_trainer_log_probs_and_reconnects_under_a_new_name(rig):
    """--vllm_sync_with_ray: the same bucket plan and loading path, the broadcasts through ray.util.collective (a gloo
    group met through Ray); reconnect() (engine replacement) builds a fresh group under a fresh name."""
    import ray

    cfg, engines, actor, sync, tok = rig
    rollouts = engines.generate(prompts(tok, 8), SamplingSpec(max_new_tokens=6, seed=2))
    batch, _ = rollouts_to_batch(rollouts, tok.pad_token_id)
    ray_sync = WeightSync(actor, engines, backend="gloo", bucket_mb=0.5, timeout_s=120, with_ray=True)
    assert len(ray_sync.buckets) > 1
    first = ray_sync.group_name
    ray_sync.reconnect()
    assert ray_sync.group_name != first

    def joined(worker, name):  # run in each engine's vLLM worker
        return ray.util.collective.is_group_initialized(name)

    assert engines.call(EngineActor.collective_rpc, joined, (ray_sync.group_name,)).get() == [[True], [True]]
    assert engines.call(EngineActor.collective_rpc, joined, (first,)).get() == [[False], [False]]  # left

    old = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
    adv = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(1))
    actor.call_sharded(
        PolicyWorker.train_step,
        Experience(batch.sequences, batch.attention_mask, batch.action_mask, action_log_probs=old, advantages=adv),
    ).get()
    new = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
    assert (new - old)[batch.action_mask].abs().max() > 1e-4, "the train step did not move the policy"
    try:
        ray_sync.sync(version=2)
        seqs = [r.prompt_ids + r.response_ids for r in rollouts]
        for engine_lp in engines.call(EngineActor.sequence_logprobs, seqs).get(timeout_s=120):
            for i, r in enumerate(rollouts):
                n = len(r.response_ids)
                got = torch.tensor(engine_lp[i][-n:])
                assert (got - new[i, :n]).abs().max() <= 1e-3, (i, got, new[i, :n])
    finally:
        sync.reconnect()  # the module's own gloo group again; every member leaves the Ray group first
    assert engines.call(EngineActor.collective_rpc, joined, (ray_sync.group_name,)).get() == [[False], [False]]


def test_delta_sync_is_full_first_and_after_a_reconnect(rig):
    """--vllm_sync_delta through WeightSync: a new WeightSync (what a start, a restart from a checkpoint or a resume
    builds) syncs in full first; an unchanged model then sends its counts only; after reconnect() (an engine was
    replaced) the next sync is full again; the engines equal the trainer throughout (fp32 engines here: an update
    changes nearly every element, so that delta goes whole; tests/vllm/test_delta_sync.py has the bf16 ones)."""
    from orlhf.rollout.weight_sync import _nbytes

    cfg, engines, actor, sync, tok = rig
    rollouts = engines.generate(prompts(tok, 8), SamplingSpec(max_new_tokens=6, seed=3))
    batch, _ = rollouts_to_batch(rollouts, tok.pad_token_id)
    seqs = [r.prompt_ids + r.response_ids for r in rollouts]
    delta = WeightSync(actor, engines, backend="gloo", bucket_mb=0.5, timeout_s=120, delta=True)
    full = sum(_nbytes(m) for m in delta.metas)
    try:
        for version, want in ((3, "full"), (4, "counts"), (5, "update"), (6, "full after reconnect")):
            if want == "update":
                old = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
                adv = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(version))
                exp = Experience(batch.sequences, batch.attention_mask, batch.action_mask, old, advantages=adv)
                actor.call_sharded(PolicyWorker.train_step, exp).get()
            if want == "full after reconnect":
                delta.reconnect()
            delta.sync(version)
            print(f"\n[delta] sync {version} ({want}): {delta.sent_bytes} bytes of a full {full}")
            if want.startswith("full"):
                assert delta.sent_bytes >= full
            else:  # counts only; or the changed elements, each tensor no larger than whole
                assert delta.sent_bytes < (full / 100 if want == "counts" else full + 8 * len(delta.metas))
            new = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
            for engine_lp in engines.call(EngineActor.sequence_logprobs, seqs).get(timeout_s=120):
                for i, r in enumerate(rollouts):
                    n = len(r.response_ids)
                    assert (torch.tensor(engine_lp[i][-n:]) - new[i, :n]).abs().max() <= 1e-3, (version, i)
    finally:
        sync.reconnect()  # the module's own group again


def check_rollout_contract(backend, tok, version: int) -> None:
    """What the controller, executors and evaluator rely on of any rollout backend (orlhf/rollout/backend.py)."""
    from orlhf.rollout.backend import EngineProcesses, RolloutBackend
    from orlhf.rollout.executor import turn_params_class

    assert isinstance(backend, RolloutBackend) and len(backend) >= 1
    ps = prompts(tok, 3)
    sampling = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=6, max_len=64, n=2, seed=11)
    first = backend.generate(ps, sampling)
    assert [r.prompt_index for r in first] == [0, 0, 1, 1, 2, 2]  # sampling.n per prompt, prompt-major
    assert all(r.prompt_ids == ps[r.prompt_index] and 1 <= len(r.response_ids) <= 6 for r in first)
    assert all(len(r.logprobs) == len(r.response_ids) and max(r.logprobs) <= 0.0 for r in first)
    assert [r.response_ids for r in backend.generate(ps, sampling)] == [r.response_ids for r in first]  # seeded
    assert backend.load_weights(version) >= 0.0
    assert {r.weight_version for r in backend.generate(ps, sampling)} == {version}  # tagged with the load's version
    params = turn_params_class(backend)(n=1, temperature=1.0, max_tokens=4, logprobs=0, seed=3)
    (turn,) = backend.generate_turns(0, [(ps[0], params)]).result(timeout=120)
    ids, lps, turn_version = turn.token_ids, turn.logprobs, turn.weight_version
    assert 1 <= len(ids) <= 4 and len(lps) == len(ids) and turn_version == version
    assert not isinstance(backend, EngineProcesses) or backend.dead() == {}  # members of its own: all alive


def test_both_rollout_backends_keep_the_contract(rig):
    """vLLM engines with their weight sync, and the actor's own ranks: the same calls, the same promises."""
    from orlhf.rollout.actor_rollout import ActorRollout
    from orlhf.rollout.backend import EngineProcesses
    from orlhf.rollout.vllm_rollout import VllmRollout

    _, engines, actor, sync, tok = rig
    vllm = VllmRollout(engines, sync)
    check_rollout_contract(vllm, tok, version=7)
    assert isinstance(vllm, EngineProcesses) and vllm.why_not_replaceable() is None and vllm.generating_groups == ()
    trainer = ActorRollout(actor, tok.pad_token_id, tok.eos_token_id)
    try:
        check_rollout_contract(trainer, tok, version=8)
        assert not isinstance(trainer, EngineProcesses) and trainer.generating_groups == (actor,)
    finally:
        trainer.shutdown()


def test_dead_engine_is_named_and_leaves_no_process(rig):
    cfg, _, _, _, tok = rig
    # a generous start-up bound: a loaded CI machine took over 120 s to start this engine (its death is what is timed)
    group = EngineGroup(engine_config(cfg), [EngineBundles(None, [0], 0.0)], timeout_s=600, tuning=CpuTuning())
    pid = group.call(EngineActor.pid).get()[0]
    long = SamplingSpec(max_new_tokens=cfg.ppo.generate_max_len, n=64, seed=0)
    call = group.call_rank(0, EngineActor.generate, list(enumerate(prompts(tok, 32))), long)
    time.sleep(1.0)
    os.kill(pid, 9)  # the engine dies mid-generation
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        call.get(timeout_s=60)
    assert time.monotonic() - t0 < 60
    assert err.value.role == "vllm engine" and err.value.rank == 0 and "died" in str(err.value)
    time.sleep(1.0)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # in-process vLLM: the engine's process was the whole engine, nothing orphaned
    group.shutdown()
