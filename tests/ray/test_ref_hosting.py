"""A guest role inside a host group's rank processes (cpu/hosting.py, CpuGroup.host: on CPU the reference in the
actor's ranks).

probes (no DeepSpeed, cheap)   host + guest drawing random numbers: the host's draws are those it makes alone,
                               the guest's are its own seed's; pids shared; errors name the guest and the host;
                               a one-rank host's guest's `beside` method runs during the host's call; two
                               guests' beside calls run side by side
real workers (2 ranks each)    PolicyWorker with a hosted ReferenceWorker beside a ReferenceWorker in its own
                               processes: equal log-probs (bit for bit), while the actor's forwards run at the
                               same time (ZeRO collectives of two workers on one process group, in turn order);
                               a dead actor rank fails the ref's next call with an error naming both
hosted critic (1 rank)         a CriticWorker beside a one-rank PolicyWorker and one in its own process: the
                               same values and train stats, bit for bit, while the actor trains beside it
"""

import sys
import time

import pytest
import ray.cloudpickle
import torch

from orlhf.config.resolve import finish_config
from orlhf.config.worker_config import worker_config
from orlhf.cpu.hosting import cpu_group
from orlhf.distributed.endpoints import endpoint
from orlhf.distributed.groups import RankError
from orlhf.distributed.placement import RankBundle
from orlhf.types import SequenceBatch
from orlhf.workers import PolicyWorker, ReferenceWorker
from orlhf.workers.base import DeepSpeedWorker

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
TWO = [RankBundle(None, 0, 0.5)] * 2  # no placement group: two ranks wherever Ray puts them


class Probe:
    """Seeds the process like DeepSpeedWorker.init does and draws from torch's global generator."""

    def __init__(self, cfg):
        self.cfg = cfg

    @endpoint
    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    @endpoint
    def draw(self) -> float:
        return torch.rand(1).item()

    @endpoint
    def threads(self) -> int:
        torch.ones(64, 64) @ torch.ones(64, 64)  # an OpenMP region on this pool thread
        return torch.get_num_threads()

    @endpoint
    def fail(self) -> None:
        raise ValueError("probe failure")

    @endpoint
    def hold(self, seconds: float) -> list[float]:
        """Draws, sleeps (a long call of the host), draws again."""
        import time

        first = torch.rand(1).item()
        time.sleep(seconds)
        return [first, torch.rand(1).item()]

    @endpoint
    def count(self, batch: list) -> int:
        return len(batch)

    @endpoint
    def count_slowly(self, batch: list) -> int:
        import time

        time.sleep(4.0)
        return len(batch)


class GuestProbe(Probe):
    pass


def test_a_guest_runs_in_the_hosts_processes_on_its_own_random_numbers(ray_local):
    host = cpu_group("actor", Probe, None, TWO, device="cpu", gpus_per_node=2, guests=["ref"])
    guest = host.host("ref", GuestProbe, None)
    try:
        assert guest.pids() == host.pids() and len(set(host.pids())) == 2
        assert len(set(host.processes + guest.processes)) == 2  # what cpu/threads.py counts
        host.call(Probe.seed, 0).get()
        guest.call(GuestProbe.seed, 1).get()  # would reset the host's generator in a shared RNG
        got_host, got_guest = [], []
        for _ in range(3):
            got_host.append(host.call_rank(0, Probe.draw).get()[0])
            got_guest.append(guest.call_rank(0, GuestProbe.draw).get()[0])
        torch.manual_seed(0)
        assert got_host == [torch.rand(1).item() for _ in range(3)]  # as if the guest were not there
        torch.manual_seed(1)
        assert got_guest == [torch.rand(1).item() for _ in range(3)]
        with pytest.raises(RankError, match=r"ref rank \d failed in fail\(\) \(in actor rank \d's process\)"):
            guest.call(GuestProbe.fail).get()
        assert len(host.call(Probe.draw).get()) == 2  # a failed call still passes the turn on
        with pytest.raises(ValueError, match="guest 'critic'"):
            host.host("critic", GuestProbe, None)
        host.set_cpu_threads(2)  # per role in one process (cpu/threads.py): each call runs with its own role's count
        guest.set_cpu_threads(1)
        for _ in range(3):
            calls = [host.call(Probe.threads), guest.call(GuestProbe.threads)]
            assert [c.get() for c in calls] == [[2, 2], [1, 1]]
        guest.shutdown()  # lets go only: the host's processes live on
        assert len(host.pids()) == 2
    finally:
        host.shutdown()


def test_a_frozen_guests_forward_runs_beside_a_one_rank_hosts_call(ray_local):
    """A `beside` method: at one rank the guest's call runs at once beside the host's call in flight, and the
    host's random numbers are those it draws alone; with two ranks it waits its turn like any call."""
    import ray

    one = cpu_group("actor", Probe, None, [RankBundle(None, 0, 0.5)], device="cpu", guests=["ref"])
    two = cpu_group("actor", Probe, None, TWO, device="cpu", gpus_per_node=2, guests=["ref"])
    try:
        methods = (GuestProbe.count,)
        guest1, guest2 = one.host("ref", GuestProbe, None, methods), two.host("ref", GuestProbe, None, methods)
        one.call(Probe.seed, 0).get()
        held = one.call(Probe.hold, 5.0)
        numbered = guest1.call(GuestProbe.count, [1, 2, 3])  # not a beside call: waits for the host's call
        beside = guest1.call_sharded(GuestProbe.count, [1, 2, 3])
        assert beside.get() == [3]
        assert not ray.wait(held.refs + numbered.refs, num_returns=2, timeout=0)[0]  # both still waiting
        assert numbered.get() == [3]
        torch.manual_seed(0)
        assert held.get() == [[torch.rand(1).item(), torch.rand(1).item()]]  # as if the guest were not there
        start = time.monotonic()
        held2 = two.call(Probe.hold, 3.0)
        waited = guest2.call_sharded(GuestProbe.count, [1, 2, 3, 4])  # two ranks: numbered, in turn
        assert waited.get() == [2, 2]
        # it ran after the host's 3 s call on each rank (a beside call would be back at once); the host's results
        # themselves may reach this driver a moment later, so the time is what shows the order
        assert time.monotonic() - start >= 2.9
        assert len(held2.get()) == 2
    finally:
        one.shutdown()
        two.shutdown()


@pytest.fixture(scope="module")
def hosted_and_own(tmp_path_factory):
    """An actor with a hosted ref, and a ref in processes of its own; 2 ranks each, all inits at once."""
    import ray

    from tests.conftest import TEST_CLUSTER_CPUS

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=TEST_CLUSTER_CPUS, include_dashboard=False)
    flags = {
        "device": "cpu",
        "advantage_estimator": "group_norm",
        "n_samples_per_prompt": 4,
        "use_kl_loss": True,
        "train_batch_size": 8,
        "rollout_batch_size": 2,
        "micro_train_batch_size": 2,
        "micro_rollout_batch_size": 2,
        "actor_num_gpus_per_node": 2,
        "ref_num_gpus_per_node": 2,
    }
    cfg = finish_config(flags, explicit=set(flags))
    actor = cpu_group(
        "actor",
        PolicyWorker,
        worker_config(cfg, "actor", 4),
        TWO,
        device="cpu",
        gpus_per_node=2,
        timeout_s=300,
        guests=["ref"],
    )
    ref_cfg = worker_config(cfg, "ref", 4)
    groups = {
        "actor": actor,
        "hosted": actor.host("ref", ReferenceWorker, ref_cfg),
        "own": cpu_group("ref", ReferenceWorker, ref_cfg, TWO, device="cpu", gpus_per_node=2, timeout_s=300),
    }
    for call in [g.call(DeepSpeedWorker.init) for g in groups.values()]:  # the actor's first, as bring-up does
        call.get()
    yield cfg, groups
    for g in groups.values():
        g.shutdown()


def batch_of(vocab: int, b: int = 6, t: int = 10, a: int = 5) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(4, vocab, (b, t), generator=g)
    attn = torch.ones(b, t, dtype=torch.long)
    for i in range(b):
        attn[i, : i % 3] = 0  # left padding of the prompt
        attn[i, t - a + 1 + i % (a - 1) :] = 0  # right padding of the response
    return SequenceBatch(seq, attn, attn[:, -a:].bool())


def test_hosted_ref_gives_a_separate_refs_log_probs_in_the_actors_processes(hosted_and_own):
    cfg, g = hosted_and_own
    from transformers import AutoConfig

    batch = batch_of(AutoConfig.from_pretrained(cfg.data.pretrain).vocab_size)
    assert g["hosted"].pids() == g["actor"].pids()
    assert not set(g["own"].pids()) & set(g["actor"].pids())
    for _ in range(2):  # the score phase: the actor's and the ref's forwards started together on both ranks
        old_call = g["actor"].call_sharded(PolicyWorker.log_probs, batch)
        hosted_call = g["hosted"].call_sharded(ReferenceWorker.log_probs, batch)
        own = g["own"].call_sharded(ReferenceWorker.log_probs, batch).get_cat()
        hosted, old = hosted_call.get_cat(), old_call.get_cat()
        mask = batch.action_mask
        assert hosted.shape == own.shape == old.shape == mask.shape
        assert torch.equal(hosted[mask], own[mask])
        assert torch.isfinite(old[mask]).all()


def test_a_dead_actor_rank_takes_its_hosted_ref_down_with_a_clear_error(hosted_and_own):
    import ray

    cfg, g = hosted_and_own
    ray.kill(g["actor"].actors[1], no_restart=True)
    batch = batch_of(16)
    with pytest.raises(
        RankError,
        match=r"ref rank 1 failed in log_probs\(\) \(in actor rank 1's process\):"
        r"\nthe rank actor died",
    ):
        g["hosted"].call_sharded(ReferenceWorker.log_probs, batch).get(timeout_s=120)


def test_two_guests_beside_a_one_rank_host_run_side_by_side(ray_local):
    """Per-guest turns for calls beside the host: async mode's reference scored ahead and a hosted critic's
    train step do not wait for each other (nor for the host's call in flight)."""
    import time

    import ray

    one = cpu_group("actor", Probe, None, [RankBundle(None, 0, 0.5)], device="cpu", guests=["ref", "critic"])
    try:
        ref = one.host("ref", GuestProbe, None, beside=(GuestProbe.count_slowly,))
        critic = one.host("critic", GuestProbe, None, beside=(GuestProbe.count,))
        assert len(set(one.processes + ref.processes)) == 1  # the ref counts as the actor's process...
        assert len(set(one.processes + critic.processes)) == 2  # ...the critic, working beside it, as its own
        held = one.call(Probe.hold, 5.0)
        ref_held = ref.call_sharded(GuestProbe.count_slowly, [1, 2, 3])
        time.sleep(1.0)  # the ref's call is running
        assert critic.call_sharded(GuestProbe.count, [1, 2]).get(timeout_s=3) == [2]
        assert not ray.wait(held.refs + ref_held.refs, num_returns=2, timeout=0)[0]  # both still running
        held.get(), ref_held.get()
    finally:
        one.shutdown()


def test_a_critic_hosted_beside_a_one_rank_actor_trains_as_one_in_its_own_process(ray_local):
    """hosting_rules.host_of puts a one-rank critic (no dropout) in a one-rank actor's process, its values and train
    steps beside the actor's calls: the same values and train stats, bit for bit, as a critic in a process of its own,
    while the actor trains at the same time."""
    from orlhf.types import Experience
    from orlhf.workers import CriticWorker

    flags = {
        "device": "cpu",
        "train_batch_size": 6,
        "rollout_batch_size": 6,
        "micro_train_batch_size": 3,
        "micro_rollout_batch_size": 3,
    }
    cfg = finish_config(flags, explicit=set(flags))
    one = [RankBundle(None, 0, 0.5)]
    actor = cpu_group(
        "actor", PolicyWorker, worker_config(cfg, "actor", 4), one, device="cpu", timeout_s=300, guests=["critic"]
    )
    critic_cfg = worker_config(cfg, "critic", 4)
    hosted = actor.host("critic", CriticWorker, critic_cfg, beside=(CriticWorker.values, CriticWorker.train_step))
    own = cpu_group("critic", CriticWorker, critic_cfg, one, device="cpu", timeout_s=300)
    try:
        for call in [g.call(DeepSpeedWorker.init) for g in (actor, hosted, own)]:
            call.get()
        from transformers import AutoConfig

        batch = batch_of(AutoConfig.from_pretrained(cfg.data.pretrain).vocab_size)
        g = torch.Generator().manual_seed(1)
        b, a = batch.action_mask.shape
        for _ in range(2):
            values = hosted.call_sharded(CriticWorker.values, batch).get_cat()
            assert torch.equal(values, own.call_sharded(CriticWorker.values, batch).get_cat())
            exp = Experience(
                batch.sequences,
                batch.attention_mask,
                batch.action_mask,
                action_log_probs=None,
                advantages=torch.randn(b, a, generator=g),
                returns=torch.randn(b, a, generator=g),
                values=values,
            )
            actor_call = actor.call_sharded(PolicyWorker.train_step, exp)
            hosted_call = hosted.call_sharded(CriticWorker.train_step, exp)
            own_stats = own.call_sharded(CriticWorker.train_step, exp).get()
            assert [vars(s) for s in hosted_call.get()] == [vars(s) for s in own_stats]
            assert actor_call.get()  # the actor trained beside it
        assert torch.equal(
            hosted.call_sharded(CriticWorker.values, batch).get_cat(),
            own.call_sharded(CriticWorker.values, batch).get_cat(),
        )
    finally:
        for grp in (hosted, own, actor):
            grp.shutdown()
