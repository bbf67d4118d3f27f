"""What keeps a stop from waiting on Ray (distributed/ray_start.py, distributed/processes.py): ray.init installs no
SIGTERM handler of its own in the driver, the local cluster's processes share a process group of their own (a signal
to the driver's group does not reach them) that ends with the driver, and a stop ends every process the driver
started, one that ignores SIGTERM and one orphaned on the way included."""

import os
import signal
import subprocess
import sys
import time

import psutil

from orlhf.distributed.ray_start import signal_handlers_kept


def test_ray_init_keeps_the_runs_sigterm_handler():
    from ray._private import utils

    def ours(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, ours)
    try:
        with signal_handlers_kept():
            utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))  # what ray.init calls
            assert signal.getsignal(signal.SIGTERM) is ours
        utils.set_sigterm_handler(before)  # outside, Ray's own function again
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_local_clusters_processes_share_a_group_of_their_own_that_ends_with_the_driver():
    """Ray's processes (as ray.init starts them: through services.ConsolePopen) join one process group apart from the
    driver's, and the reaper started beside them ends the group once the driver's pipe to it closes (the driver
    exited, however: SIGKILL included)."""
    from ray._private import services

    from orlhf.distributed import processes

    with processes.own_process_group():
        first = services.ConsolePopen(["sleep", "30"])
        second = services.ConsolePopen(["sleep", "30"])
    outside = services.ConsolePopen(["sleep", "30"])
    reaper = processes._REAPER
    try:
        group = os.getpgid(first.pid)
        assert group == first.pid != os.getpgid(0) and os.getpgid(second.pid) == group
        assert os.getpgid(reaper.pid) == group
        assert os.getpgid(outside.pid) == os.getpgid(0)  # Ray's own class again
        processes.end_reaper()  # as when the driver is gone: its pipe closes
        for p in (first, second):
            assert p.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)
        assert outside.poll() is None
    finally:
        for p in (first, second, outside):
            p.kill()
            p.wait()


DRIVER = """
import subprocess, sys, time
from orlhf.distributed.processes import end_descendants
stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 60 & wait"])      # ignores SIGTERM
parent = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True)
time.sleep(0.5)
print(" ".join(str(p.pid) for p in __import__("psutil").Process().children(recursive=True)), flush=True)
end_descendants(2.0)
print("ended", flush=True)
time.sleep(60)
"""


def test_a_stop_ends_every_process_the_driver_started():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) >= 5  # two bash processes and their three sleeps
        t0 = time.monotonic()
        assert driver.stdout.readline().strip() == "ended"
        assert time.monotonic() - t0 < 5
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert alive == []
    finally:
        driver.kill()
        driver.wait()


def test_the_reaper_of_an_empty_group_ends_alone_without_its_sweep():
    """At a run's normal end the cluster's processes are gone before the reaper is ended: it is then ended by a
    plain SIGTERM (no second of grace for a group sweep); its sweep would have ended it by SIGKILL."""
    from ray._private import services

    from orlhf.distributed import processes

    with processes.own_process_group():
        first = services.ConsolePopen(["true"])
    first.wait(timeout=10)
    reaper = processes._REAPER
    processes.end_reaper()
    assert reaper.returncode == -signal.SIGTERM and processes._REAPER is None


SPARING = """
import subprocess, sys, time
from orlhf.distributed.processes import end_descendants
head = subprocess.Popen(["sleep", "60"])
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(0.5)
spared = end_descendants(4.0, spare=("sleep",))
print(head.pid, worker.pid, worker.wait(timeout=5), " ".join(str(p.pid) for p in spared), flush=True)
time.sleep(60)
"""


def test_a_stop_spares_the_named_processes_for_last():
    """A stop ends every process of the run but the local cluster's GCS and raylet, which it kills outright just
    before exiting (launch/stop_signals.py): a Ray call of the main thread that sees its GCS go aborts the driver.
    (In a driver of its own: this test process may hold the session's Ray cluster.)"""
    driver = subprocess.Popen([sys.executable, "-c", SPARING], stdout=subprocess.PIPE, text=True)
    head = None
    try:
        head, worker, worker_rc, spared = driver.stdout.readline().split()
        assert spared == head and int(worker_rc) == -signal.SIGTERM
        assert psutil.pid_exists(int(head)) and psutil.Process(int(head)).status() != psutil.STATUS_ZOMBIE
    finally:
        driver.kill()
        driver.wait()
        if head is not None:
            try:
                os.kill(int(head), signal.SIGKILL)
            except ProcessLookupError:
                pass
