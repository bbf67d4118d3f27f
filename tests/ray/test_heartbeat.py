"""Health checks of calls in flight (distributed/heartbeat.py), on real rank actors: a call longer than
--hang_timeout_s on a live process is not hung (its pings run beside it, also beside a guest's call waiting its
turn on CPU), and a process stopped with SIGSTOP is named hung within the timeout by every wait (GroupCall.get,
settle, wait_calls, the dead() health check), where before its call waited for --ray_timeout_s."""

import os
import signal
import sys
import time

import psutil
import pytest
import ray.cloudpickle

from orlhf.cpu.hosting import cpu_group
from orlhf.distributed.endpoints import endpoint
from orlhf.distributed.groups import ActorGroup, RankError, settle, wait_calls
from orlhf.distributed.placement import RankBundle

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
HANG_S = 1.0  # pings every 0.5 s (half of it), so a stopped process is named within about 1.5 s
ONE = [RankBundle(None, 0, 0.25)]


class Napper:
    def __init__(self, cfg):
        self.cfg = cfg

    @endpoint
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()


def groups(kind: str) -> tuple:
    """(the group calls go to, the group that owns the processes)."""
    if kind == "rank_actor":
        g = ActorGroup("actor", Napper, None, ONE, device="cpu", timeout_s=120, hang_s=HANG_S)
        return g, g
    host = cpu_group("actor", Napper, None, ONE, guests=("ref",), device="cpu", timeout_s=120, hang_s=HANG_S)
    return host.host("ref", Napper, None), host


@pytest.mark.parametrize("kind", ["rank_actor", "cpu_guest"])
def test_a_long_call_is_not_hung_and_a_stopped_process_is(ray_local, kind):
    group, owner = groups(kind)
    (pid,) = owner.pids()
    try:
        long = owner.call(Napper.nap, 3 * HANG_S)
        # on CPU the guest's call waits its turn behind the host's: both wait longer than HANG_S, neither is hung
        assert group.call(Napper.nap, 0.0).get() == [pid]
        assert long.get() == [pid]

        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankError) as err:
            group.call(Napper.nap, 0.0).get()
        took = time.monotonic() - t0
        assert err.value.hung and err.value.died and err.value.rank == 0, err.value
        assert "no answer to a health check" in str(err.value) and "--hang_timeout_s" in str(err.value)
        assert took < 2 * HANG_S + 5, took  # before: a wait of the call's whole timeout (120 s here)

        print(f"{kind}: named hung after {took:.1f} s")
        if kind == "cpu_guest":
            return  # the waits below are the same code for both kinds
        results, lost, failed = settle(group.call(Napper.nap, 0.0), 60)
        assert not results and not failed and lost[0].hung
        with pytest.raises(RankError, match="health check"):
            wait_calls(group.call(Napper.nap, 0.0), timeout_s=60)
        dead = owner.dead(timeout_s=1)
        assert list(dead) == [0] and dead[0].hung
    finally:
        owner.shutdown()  # kills the stopped process: what a restart does with a hung rank
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the stopped process outlived its group's shutdown"
        time.sleep(0.2)
