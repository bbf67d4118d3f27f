"""Model groups through Ray on real placement groups: 2-rank ZeRO-3 workers behave like one plain model.

One module-scoped set of groups (DeepSpeed start-up dominates): actor world size 2 and 1, critic and reward
world size 2, on the placement groups that `plan_layout` builds from the flags.
"""

import time

import pytest
import torch

from orlhf.config.resolve import finish_config
from orlhf.config.worker_config import RewardConfig, worker_config
from orlhf.distributed.groups import ActorGroup, RankError
from orlhf.distributed.placement import RankBundle, create_placement_groups, remove_placement_groups
from orlhf.launch.bringup import run_layout
from orlhf.types import Experience, SequenceBatch
from orlhf.workers import CriticWorker, PolicyWorker, RewardWorker
from orlhf.workers.base import DeepSpeedWorker

pytestmark = pytest.mark.ray
B, A = 8, 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import ray

    from tests.conftest import TEST_CLUSTER_CPUS

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=TEST_CLUSTER_CPUS, include_dashboard=False)
    flags = {
        "train_batch_size": B,
        "micro_train_batch_size": 2,
        "rollout_batch_size": B,
        "actor_num_gpus_per_node": 2,
        "critic_num_gpus_per_node": 2,
        "device": "cpu",
    }
    cfg = finish_config(flags, explicit=set(flags))
    # A tiny random reward model with the demo's shapes (plumbing, not learning).
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    rm_dir = tmp_path_factory.mktemp("rm")
    mcfg = AutoConfig.from_pretrained(cfg.data.pretrain, num_labels=1)
    torch.manual_seed(3)
    LlamaForSequenceClassification(mcfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(cfg.data.pretrain).save_pretrained(rm_dir)

    layout = run_layout(cfg)
    placed = create_placement_groups(layout, timeout_s=60)
    t0 = time.monotonic()
    actor_cfg = worker_config(cfg, "actor", total_optimizer_steps=4)
    groups = {
        "actor": ActorGroup(
            "actor", PolicyWorker, actor_cfg, placed.role_bundles("actor"), device="cpu", gpus_per_node=2, timeout_s=300
        ),
        "actor1": ActorGroup("actor", PolicyWorker, actor_cfg, [RankBundle(None, 0, 0.5)], device="cpu", timeout_s=300),
        "critic": ActorGroup(
            "critic",
            CriticWorker,
            worker_config(cfg, "critic", 4),
            placed.role_bundles("critic"),
            device="cpu",
            gpus_per_node=2,
            timeout_s=300,
        ),
        "reward": ActorGroup(
            "reward",
            RewardWorker,
            RewardConfig(model_path=str(rm_dir), device="cpu"),
            [RankBundle(None, 0, 0.5)] * 2,
            device="cpu",
            gpus_per_node=2,
            timeout_s=300,
        ),
    }
    inits = [g.call(DeepSpeedWorker.init) for g in groups.values()]
    for call in inits:
        call.get()
    startup = time.monotonic() - t0
    print(f"\n[groups] 4 groups (6 DeepSpeed ranks) started in {startup:.1f} s")
    yield cfg, groups, str(rm_dir)
    for g in groups.values():
        g.shutdown()
    remove_placement_groups(placed)


def make_batch(vocab: int, seed: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    T = 5 + A
    seq = torch.randint(4, vocab, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    for i in range(B):
        attn[i, : i % 4] = 0  # left padding of the prompt
        attn[i, T - A + 1 + i % (A - 1) :] = 0  # right padding of the response
    seq[attn == 0] = 2
    return SequenceBatch(seq, attn, attn[:, -A:].bool())


def hf_log_probs(path: str, batch: SequenceBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask, position_ids=pos).logits
    lp = torch.log_softmax(logits[:, -A - 1 : -1].float(), -1).gather(-1, batch.sequences[:, -A:, None]).squeeze(-1)
    return lp * batch.action_mask


def test_zero3_log_probs_equal_plain_hf(setup):
    cfg, groups, _ = setup
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(cfg.data.pretrain).vocab_size)
    got = groups["actor"].call_sharded(PolicyWorker.log_probs, batch).get_cat() * batch.action_mask
    want = hf_log_probs(cfg.data.pretrain, batch)
    assert got.shape == (B, A)
    assert (got - want).abs().max() <= 1e-5


def test_train_step_world_size_2_equals_world_size_1(setup):
    cfg, groups, _ = setup
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(cfg.data.pretrain).vocab_size, seed=1)
    old = groups["actor1"].call_sharded(PolicyWorker.log_probs, batch).get_cat()
    g = torch.Generator().manual_seed(5)
    exp = Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=old,
        advantages=torch.randn(B, A, generator=g),
    )
    before = groups["actor1"].call_rank(0, PolicyWorker.state_dict_full).get()[0]
    stats2 = groups["actor"].call_sharded(PolicyWorker.train_step, exp).get()
    stats1 = groups["actor1"].call_sharded(PolicyWorker.train_step, exp).get()
    after2 = groups["actor"].call(PolicyWorker.state_dict_full).get()[0]
    after1 = groups["actor1"].call_rank(0, PolicyWorker.state_dict_full).get()[0]
    assert all(s.micro_steps == 2 for s in stats2) and stats1[0].micro_steps == 4
    moved = max((after1[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4, "the train step did not change the parameters"
    diff = max((after1[k] - after2[k]).abs().max().item() for k in before)
    assert diff <= 1e-5, f"world size 2 and 1 differ by {diff} after one step"


def test_critic_values_and_reward_scores_in_caller_order(setup):
    cfg, groups, rm_dir = setup
    from transformers import AutoConfig, AutoModelForSequenceClassification

    batch = make_batch(AutoConfig.from_pretrained(cfg.data.pretrain).vocab_size, seed=2)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    shuffled = SequenceBatch(batch.sequences[perm], batch.attention_mask[perm], batch.action_mask[perm])
    values, values_shuffled = (
        groups["critic"].call_sharded(CriticWorker.values, b).get_cat() for b in (batch, shuffled)
    )
    assert values.shape == (B, A)
    assert torch.allclose(values[perm], values_shuffled, atol=1e-5)

    scores = groups["reward"].call_sharded(RewardWorker.scores, batch).get_cat()
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.flip(-1).argmax(-1)  # last real token
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        per_token = rm(input_ids=batch.sequences, attention_mask=batch.attention_mask, position_ids=pos).logits
    want = per_token.squeeze(-1)[torch.arange(B), last] if per_token.dim() == 3 else per_token.squeeze(-1)
    assert scores.shape == (B,)
    assert torch.allclose(scores, want, atol=1e-4), (scores, want)


def test_a_failing_rank_names_role_rank_and_traceback(setup):
    cfg, groups, _ = setup
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(cfg.data.pretrain).vocab_size
    batch = make_batch(vocab, seed=3)
    batch.sequences[B // 2 :, -A] = vocab + 100  # only rank 1's half: an out-of-vocabulary first response token
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        groups["reward"].call_sharded(RewardWorker.scores, batch).get()
    assert time.monotonic() - t0 < 60
    assert err.value.role == "reward" and err.value.rank == 1 and err.value.method == "scores"
    assert "IndexError" in str(err.value) or "index" in str(err.value).lower()
    assert "File " in str(err.value)  # the remote traceback
