"""The per-phase thread plan (orlhf/cpu/threads.py): who works in each phase and how many threads each gets.

Recording stand-ins for the groups (pure logic: the plan and what it sends); tests/ray/test_thread_handover.py checks on
real rank actors that a sent count reaches the threads that do the work."""

from types import SimpleNamespace

from orlhf.config.flags import build_config
from orlhf.cpu.threads import PhaseThreads, cluster_priority_env, engine_threads, processes, share
from orlhf.rollout.actor_rollout import ActorRollout


class Group:
    """`processes`: one key per rank process, as CpuGroup.processes (a guest shares its host's); None: a group
    without it (its ranks count as processes of their own)."""

    def __init__(self, name, world_size, sent, processes=None):
        self.name, self.world_size, self.sent = name, world_size, sent
        if processes is not None:
            self.processes = processes

    def set_cpu_threads(self, n):
        self.sent.append((self.name, n))


def plan(cores=2, hosted=False, **flags):
    """hosted: the ref's ranks in the actor's processes (cpu/hosting_rules.host_of)."""
    cfg = build_config({"device": "cpu", **flags}, set(flags) | {"device"})
    sent = []
    actor = Group("actor", 1, sent, processes=["actor-0"])
    # the actor's ranks generate with --rollout_backend trainer (the backend names them); vLLM engines are no group
    rollout = ActorRollout(actor, 0, None) if cfg.rollout.in_actor else SimpleNamespace(generating_groups=())
    models = SimpleNamespace(
        actor=actor,
        rollout=rollout,
        ref=Group("ref", 1, sent, ["actor-0" if hosted else "ref-0"]) if cfg.has_reference else None,
        critic=Group("critic", 1, sent) if cfg.ppo.advantage_estimator == "gae" else None,
        reward=None,
    )
    threads = PhaseThreads.from_config(cfg, models, cores=cores)
    return threads, sent


def run_step(threads):
    for phase in ("generate", "score", "make_experience", "train", "sync"):
        threads.before(phase)


GRPO = {
    "advantage_estimator": "group_norm",
    "n_samples_per_prompt": 4,
    "use_kl_loss": True,
    "rollout_batch_size": 16,
    "train_batch_size": 64,
}  # one optimizer step per batch: a single pass


def test_share():
    assert [share(2, k) for k in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert share(16, 3) == 5


def test_grpo_single_pass_gives_each_phase_s_only_process_both_cores():
    threads, sent = plan(**GRPO)  # no old-log-prob forward: score = the ref alone, train = the actor alone
    run_step(threads)
    assert sent == [("ref", 2), ("actor", 2)]  # the engines get theirs once, at start (engine_threads)
    run_step(threads)
    assert len(sent) == 2  # nothing changes in later steps: no calls


def test_phases_with_several_processes_split_the_cores():
    threads, sent = plan()  # gae: score = actor + ref + critic, train = actor + critic
    run_step(threads)
    assert sent == [("actor", 1), ("ref", 1), ("critic", 1)]  # train: actor, critic keep 1
    threads, sent = plan(cores=4, max_epochs=2, **GRPO)  # two passes: actor scores beside the ref, trains alone
    run_step(threads)
    assert sent == [("actor", 2), ("ref", 2), ("actor", 4)]


def test_nothing_handed_over_off_cpu_or_in_async_mode():
    for flags in ({"async_train": True}, {"device": "cuda"}):
        threads, sent = plan(**{**GRPO, **flags})
        run_step(threads)
        assert sent == []


def test_fixed_train_threads_are_sent_as_asked():
    threads, sent = plan(train_cpu_threads=3)  # init() set it on one pool thread; every call applies it now
    run_step(threads)
    assert sent == [("actor", 3), ("ref", 3), ("critic", 3)]


def test_async_mode_sends_only_fixed_counts():
    threads, sent = plan(async_train=True, train_cpu_threads=2, **GRPO)
    run_step(threads)
    assert sent == [("ref", 2), ("actor", 2)]


def test_counts_follow_the_flags_not_the_load():
    threads, sent = plan(cores=4, **GRPO)
    threads.before("train")
    assert sent[-1] == ("actor", 4)
    threads, sent = plan(train_cpu_threads=2, **GRPO)
    run_step(threads)
    assert sent == [("ref", 2), ("actor", 2)]  # fixed by the user


def test_processes_counts_distinct_rank_processes():
    actor = Group("actor", 2, [], processes=["a0", "a1"])
    ref = Group("ref", 2, [], processes=["a0", "a1"])  # hosted: rank k in actor rank k's process
    critic = Group("critic", 2, [])  # no keys: two processes of its own
    assert processes([actor, ref]) == 2 and processes([actor, ref, critic]) == 4 and processes([ref]) == 2
    assert processes([Group("ref", 2, [], processes=["r0", "r1"]), actor]) == 4


def test_a_hosted_ref_shares_its_process_count_with_the_actor():
    threads, sent = plan(cores=4, max_epochs=2, hosted=True, **GRPO)  # score: actor + hosted ref = 1 process
    run_step(threads)
    assert sent == [("actor", 4), ("ref", 4)]  # the actor keeps 4 to train: not sent again
    threads, sent = plan(cores=4, max_epochs=2, **GRPO)  # separate processes: 2 share the 4 cores
    run_step(threads)
    assert sent == [("actor", 2), ("ref", 2), ("actor", 4)]
    threads, sent = plan(cores=4, hosted=True)  # gae: actor + ref in one process, critic in another -> 2 each
    run_step(threads)
    assert sent == [("actor", 2), ("ref", 2), ("critic", 2)]


def test_engines_share_the_cores_in_sync_mode_and_keep_their_slots_beside_async_training():
    def threads(cores=2, **flags):
        return engine_threads(build_config({"device": "cpu", **flags}, set(flags) | {"device"}), cores=cores)

    assert threads() == 2  # sync: the one engine generates alone, the ranks wait for its rollouts
    assert threads(vllm_num_engines=2) == 1 and threads(cores=16, vllm_num_engines=3) == 5
    assert threads(async_train=True) == 0  # beside training all the time: Ray's one thread per CPU slot
    assert threads(vllm_cpu_threads=3) == 3 and threads(async_train=True, vllm_cpu_threads=2) == 2  # the user's
    assert threads(cores=1) == 1
    cuda = build_config({"device": "cuda"}, {"device"})
    assert engine_threads(cuda, cores=8) == 0  # GPUs: unused


def test_the_actor_s_ranks_get_the_cores_when_they_generate():
    threads, sent = plan(rollout_backend="trainer", **GRPO)
    threads.before("generate")
    assert sent == [("actor", 2)]  # the phase's one process: both cores
    _, sent = plan(**GRPO)
    assert "generate" not in plan(**GRPO)[0].phases  # vLLM engines get theirs at their start


def test_a_local_cpu_cluster_s_workers_run_at_the_user_s_priority_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert cluster_priority_env() == {"RAY_worker_niceness": "0"}  # Ray's own default would be 15
    monkeypatch.setenv("RAY_worker_niceness", "10")
    assert cluster_priority_env() == {}  # the user's value stays


def test_an_actor_on_a_worker_that_imported_torch_takes_ray_s_count(monkeypatch):
    """torch fixed its count when the worker imported it (the preload, or earlier work of a reused worker): the
    actor's start applies the OMP_NUM_THREADS Ray set for it, whatever count the process had."""
    import torch

    from orlhf.cpu.threads import threads_as_ray_set

    own = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # what an earlier task left
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        threads_as_ray_set()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "")  # none set: the count is left
        torch.set_num_threads(2)
        threads_as_ray_set()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(own)
