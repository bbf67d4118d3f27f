"""A lost vLLM engine replaced in place (trainer/engine_restart.py): which prompts go again, the restart budget, the
order of a replacement (new engine, fresh sync group, current weights), and the sync side that keeps the actor's
ranks in step when a broadcast fails. The Ray and vLLM side runs in tests/e2e/test_faults.py."""

import logging

import pytest

from orlhf.cli import main
from orlhf.config.flags import parse_config
from orlhf.rollout.engine_group import contiguous_chunks
from orlhf.rollout.vllm_rollout import VllmRollout
from orlhf.trainer.engine_restart import EngineRestarts
from orlhf.workers.weight_send import send_groups


class Lost(RuntimeError):
    """An engine's error as groups.RankError carries it: died, or (died False) a missed deadline."""

    def __init__(self, msg: str, died: bool = True):
        super().__init__(msg)
        self.died = died


class Engines:
    """The calls EngineRestarts makes on an EngineGroup (through VllmRollout, the backend it drives), recorded."""

    timeout_s = 600.0

    def __init__(self, log: list):
        self.log, self.on_lost = log, None

    def replace(self, index: int) -> int:
        self.log.append(("replace", index))
        return 1000 + index

    def dead(self, timeout_s: float = 10.0) -> dict:
        return {}

    def kill(self, index: int) -> None:
        self.log.append(("kill", index))


class Sync:
    """A WeightSync stand-in: `fail` sync calls raise first; lost_engines says which engines died in them."""

    restartable = True

    def __init__(self, log: list, fail: int = 0, lost: dict | None = None):
        self.log, self.fail, self.lost = log, fail, lost or {}

    def reconnect(self) -> None:
        self.log.append(("reconnect",))

    def sync(self, version: int) -> None:
        self.log.append(("sync", version))
        if self.fail:
            self.fail -= 1
            raise self.error

    error = RuntimeError("actor rank 0 failed in send_weights()")

    def lost_engines(self) -> dict:
        self.log.append(("lost_engines",))
        return self.lost


def restarts(limit=3, sync=None, backend="gloo", async_train=False, step=3, version=2):
    log = []
    cfg = parse_config(
        {"max_engine_restarts": limit, "vllm_sync_backend": backend, "async_train": async_train},
        explicit={"max_engine_restarts"},
    )
    models = type("Models", (), {"rollout": VllmRollout(Engines(log), sync or Sync(log))})()
    if sync is not None:
        sync.log = log
    return EngineRestarts.for_run(cfg, models, lambda: (step, version)), models, log


def test_chunks_are_contiguous_and_cover_the_batch_once():
    # 10 prompts over 3 engines: ceil(10 / 3) = 4 each, the last one the rest
    assert contiguous_chunks(10, 3) == [range(0, 4), range(4, 8), range(8, 10)]
    # fewer prompts than engines: the last engines get none (no call is sent to them)
    assert contiguous_chunks(2, 3) == [range(0, 1), range(1, 2), range(2, 2)]
    for n, k in [(64, 1), (64, 3), (5, 4), (1, 2)]:
        assert [i for c in contiguous_chunks(n, k) for i in c] == list(range(n))


def test_a_lost_engine_is_replaced_then_synced_at_the_current_version_before_it_serves(caplog):
    r, models, log = restarts(version=2)
    assert models.rollout.engines.on_lost == r.recover  # EngineGroup.generate calls it, then sends the chunk again
    with caplog.at_level(logging.WARNING, "orlhf"):
        r.recover({1: Lost("vllm engine rank 1 failed in generate(): the rank actor died")}, "generate")
    # the new engine first, then a fresh group for all engines (a group takes no new member), then the weights
    assert log == [("replace", 1), ("reconnect",), ("sync", 2)]
    assert r.count == 1
    assert "step 3: vllm engine 1 died during generate; replacing it" in caplog.text
    assert "step 3: vllm engine 1 replaced in " in caplog.text and "loaded with weight version 2" in caplog.text


def test_the_budget_stops_the_run_with_the_engines_own_error(caplog):
    r, _, log = restarts(limit=1)
    r.recover({0: Lost("first")}, "generate")
    hung = Lost("vllm engine: generate() did not finish on rank(s) [0] within 600 s", died=False)
    with pytest.raises(Lost, match="did not finish"), caplog.at_level(logging.ERROR, "orlhf"):
        r.recover({0: hung}, "generate")
    assert r.count == 1 and log.count(("replace", 0)) == 1
    assert (
        "vllm engine 0 gave no answer within 600 s (--ray_timeout_s) during generate; not replaced: "
        "--max_engine_restarts 1, 1 used" in caplog.text
    )


def test_zero_restarts_is_the_named_stop_of_before(caplog):
    r, _, log = restarts(limit=0)
    with pytest.raises(Lost, match="engine 0 died"), caplog.at_level(logging.ERROR, "orlhf"):
        r.recover({0: Lost("engine 0 died")}, "generate")
    assert log == [] and r.count == 0
    assert "step 3: vllm engine 0 died during generate; not replaced: --max_engine_restarts 0\n" in caplog.text


def test_two_engines_lost_at_once_count_two_and_share_one_sync():
    r, _, log = restarts(limit=2)
    r.recover({2: Lost("a"), 0: Lost("b")}, "generate")
    assert log == [("replace", 0), ("replace", 2), ("reconnect",), ("sync", 2)] and r.count == 2


def test_async_mode_and_ipc_sync_keep_the_named_stop_with_a_line_saying_why(caplog):
    r, _, log = restarts(async_train=True)
    with pytest.raises(Lost), caplog.at_level(logging.ERROR, "orlhf"):
        r.recover({0: Lost("died")}, "generate")
    assert "not replaced: --async_train" in caplog.text and log == []

    class IpcWeightSync(Sync):
        restartable = False

    caplog.clear()
    r, _, log = restarts(sync=IpcWeightSync([]))
    with pytest.raises(Lost), caplog.at_level(logging.ERROR, "orlhf"):
        r.recover({0: Lost("died")}, "generate")
    assert "not replaced: IpcWeightSync (CUDA IPC weight sync" in caplog.text and "is not restartable" in caplog.text


def test_an_engine_lost_in_a_weight_sync_is_replaced_and_the_sync_done_again():
    sync = Sync([], fail=1, lost={0: Lost("vllm engine rank 0 failed in orlhf_receive_weights(): died")})
    r, _, log = restarts(sync=sync, version=5)
    r.sync(5)
    assert log == [("sync", 5), ("lost_engines",), ("replace", 0), ("reconnect",), ("sync", 5)]
    assert r.count == 1


def test_an_engine_hung_in_a_weight_sync_is_killed_first_then_replaced(caplog):
    """Its receive would never end, and the actor's broadcast to it might not either: killed, the sync's failure
    is a dead engine's (lost_engines names it) and the replacement follows. The line says it hung: its receive's
    error after the kill is a death's."""
    from orlhf.distributed.groups import RankError

    hung = RankError("vllm engine", 0, "orlhf_receive_weights", "no answer to a health check", hung=True)
    sync = Sync([], fail=1, lost={0: Lost("vllm engine rank 0 failed in orlhf_receive_weights(): died")})
    sync.error = hung
    r, _, log = restarts(sync=sync, version=5)
    with caplog.at_level(logging.WARNING, "orlhf"):
        r.sync(5)
    assert log == [("sync", 5), ("kill", 0), ("lost_engines",), ("replace", 0), ("reconnect",), ("sync", 5)]
    assert "vllm engine 0 stopped answering health checks (--hang_timeout_s) during the weight sync" in caplog.text


def test_a_sync_failure_no_engine_caused_is_raised_as_it_was():
    r, _, log = restarts(sync=Sync([], fail=1, lost={}))
    with pytest.raises(RuntimeError, match="send_weights"):
        r.sync(3)
    assert log == [("sync", 3), ("lost_engines",)] and r.count == 0


def test_nccl_does_not_replace_an_engine_lost_during_a_sync(caplog):
    sync = Sync([], fail=1, lost={0: Lost("died in orlhf_receive_weights")})
    r, _, log = restarts(sync=sync, backend="nccl")
    with pytest.raises(Lost), caplog.at_level(logging.ERROR, "orlhf"):
        r.sync(3)
    assert "not replaced: an engine lost during an NCCL weight sync" in caplog.text
    assert ("replace", 0) not in log


def test_a_failed_broadcast_still_walks_every_group_then_raises():
    """Rank 0 stops broadcasting at the failure but keeps walking: the other ranks gather each group with it (a
    collective) and would wait forever for a rank that left the walk."""
    walked = []

    def groups():
        for k in range(4):
            walked.append(k)
            yield [(f"w{k}", object())]

    class Sender:
        sent = 0

        def broadcast(self, t):
            self.sent += 1
            if self.sent == 2:
                raise RuntimeError("Connection closed by peer")

    sender = Sender()
    with pytest.raises(RuntimeError, match="the weight broadcast to the engines failed: Connection closed by peer"):
        send_groups(sender, groups(), expected=4)
    assert walked == [0, 1, 2, 3] and sender.sent == 2


@pytest.mark.parametrize("value, code", [("-1", 2), ("0", 0)])
def test_negative_max_engine_restarts_exits_2_naming_the_flag(value, code, capsys, no_training):
    with pytest.raises(SystemExit) as exit_:
        main(["train-ppo", "--max_engine_restarts", value])
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    if code:
        assert "--max_engine_restarts must be >= 0 (got -1" in err and "Traceback" not in err
    else:
        assert no_training[0].vllm.max_engine_restarts == 0
