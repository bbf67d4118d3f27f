"""The Ray cluster a run uses: the one it is given or runs in (--address, RAY_ADDRESS, `ray job submit`), joined as
it is, else a local one this process starts (and run_locked shuts down), without the Ray processes such a
cluster does not need (the autoscaler monitor, the log monitor, the dashboard head) unless --verbose shows their
output. Joining a running cluster (token authentication, Ray's retries, its C++ lines) is distributed/ray_join.py's.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Optional

from orlhf.config.train_config import TrainConfig
from orlhf.distributed.ray_join import join_cluster
from orlhf.distributed.tuning import Tuning


def connect_ray(cfg: TrainConfig, num_cpus: int, processes: int = 0, tuning: Optional[Tuning] = None) -> bool:
    """Join the given / the job's cluster, else start a local one (`num_cpus` logical CPUs; `processes`: the
    run's model and engine processes; `tuning`'s ray_options for it, distributed/tuning.py). Returns True when
    this process started it."""
    import ray

    if ray.is_initialized():
        return False
    from orlhf.distributed.processes import own_process_group

    with signal_handlers_kept(), own_process_group():
        return _connect(cfg, num_cpus, processes, tuning)


def _connect(cfg: TrainConfig, num_cpus: int, processes: int, tuning: Optional[Tuning]) -> bool:
    import ray

    no_failure_handler()
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS")
    # Workers' output goes to <save_path>/logs unless --verbose (storage/logs.py); Ray's own driver-side records then go
    # to driver.log through the root logger instead of Ray's terminal handler.
    quiet = dict(log_to_driver=cfg.runtime.verbose, configure_logging=cfg.runtime.verbose)
    if not cfg.runtime.verbose:
        route_cluster_messages()
    if address:
        join_cluster(address, cfg.runtime.verbose, **quiet)
        return False
    tuning = tuning or Tuning()
    options = with_quick_connects(tuning.ray_options(cfg, num_cpus, processes))
    with environment(tuning.cluster_env(cfg)):  # inherited by the raylet, hence by every worker it starts
        if cfg.runtime.verbose:  # Ray's processes as ray.init starts them: their output is what --verbose shows
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet, **options)
            return True
        with local_cluster_without(no_monitor=True, include_log_monitor=False), no_dashboard_head():
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet, **options)
    return True


# Ray's socket connections retry every raylet_client_connect_timeout_milliseconds (1 s by default), up to
# raylet_client_num_connect_attempts times (10). A local cluster's raylet connects its object manager to the plasma
# store's socket right after starting the store's thread, which may not have created the socket yet: losing that
# race cost one whole retry interval of ray.init. Retried every 0.1 s, the same 10 s in all before Ray gives up.
QUICK_CONNECTS = {"raylet_client_connect_timeout_milliseconds": 100, "raylet_client_num_connect_attempts": 100}


def with_quick_connects(options: dict) -> dict:
    """ray.init `options` for a cluster this process starts, with QUICK_CONNECTS in its _system_config (the
    raylet, the driver and every worker read it); as they are where the user's environment (RAY_<name>) or the
    options set either of the two."""
    system = options.get("_system_config") or {}
    if any(name in system or f"RAY_{name}" in os.environ for name in QUICK_CONNECTS):
        return options
    return {**options, "_system_config": {**system, **QUICK_CONNECTS}}


@contextmanager
def environment(env: dict[str, str]):
    """os.environ with `env` set inside, as it was after (the processes started inside keep theirs)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def signal_handlers_kept():
    """ray.init (and its connect) without installing Ray's SIGTERM handler in this process: Ray 2.60 sets one that
    calls sys.exit(15) (utils.set_sigterm_handler, from worker.init and node.Node), which would end a run cut short
    while Ray starts with rc 15 and no line. The run's own handlers stay (launch/stop_signals.py)."""
    from ray._private import utils

    original = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def no_failure_handler() -> None:
    """This process's Ray core worker starts without its C++ failure signal handler (Ray 2.60's
    RAY_DISABLE_FAILURE_SIGNAL_HANDLER, read when ray.init creates it): that handler catches SIGTERM too and prints a
    C++ stack for it ("*** SIGTERM received ... PC: @"), where the run stops with its own line
    (launch/stop_signals.py). Set for this process only: the workers' and Ray's own processes keep it."""
    from ray._private import ray_constants

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


def end_ray(joined_before: bool, wait_s: float = 10.0) -> None:
    """The end of a run's Ray: nothing when this process was connected before the run (`joined_before`: a test's
    cluster, a caller's); otherwise ray.shutdown(), and for a local cluster this process started, a wait until every
    one of its processes has exited (the GCS, the raylet, the workers and what they started: vLLM's engine processes),
    those left after `wait_s` killed. Ray's shutdown only asks them to exit, so the run's engines could outlive the
    driver by seconds, holding their memory and devices."""
    import ray

    if joined_before:
        return
    processes = cluster_processes()
    ray.shutdown()
    left = wait_gone(processes, wait_s)
    for p in left:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    wait_gone(left, 5.0)
    from orlhf.distributed.processes import end_reaper

    end_reaper()


def cluster_processes() -> list:
    """The processes of the local cluster this process started and all their descendants (psutil.Process); none
    for a cluster it joined (Ray then started nothing here) or without psutil."""
    try:
        import psutil
        from ray._private import worker
    except ImportError:
        return []
    node = getattr(worker, "_global_node", None)
    if node is not None:
        pids = [i.process.pid for group in node.all_processes.values() for i in group if i.process is not None]
    else:  # a ray.init cut short (a signal) before it kept its node: Ray's processes it had started here
        pids = [p.pid for p in psutil.Process().children() if p.name() in RAY_HEAD_PROCESSES]
    found = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            found += [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    return list({p.pid: p for p in found}.values())


RAY_HEAD_PROCESSES = ("gcs_server", "raylet")


def wait_gone(processes: list, wait_s: float) -> list:
    """Wait up to `wait_s` for `processes` (psutil.Process) to exit; returns those still running (a zombie, whose
    parent has not reaped it yet, has exited)."""
    import time

    deadline = time.monotonic() + wait_s
    alive = processes
    while True:
        alive = [p for p in alive if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def route_cluster_messages() -> None:
    """What Ray's cluster publishes to this driver (a worker that died, a node that was lost, each with tens of lines
    of its raylet's log) goes to driver.log, not the terminal: Ray's driver prints it to stdout whatever log_to_driver
    says (ray 2.60's worker.listen_error_messages -> print_to_stdstream, also across the bar). orlhf's own line names
    what was lost and what the run does about it."""
    import ray._private.worker as ray_worker

    def to_log(data: dict, ignore_prefix: bool = False) -> None:
        for line in data.get("lines", []):
            logging.getLogger("ray").warning("(%s) %s", data.get("pid"), line)

    ray_worker.print_to_stdstream = to_log


@contextmanager
def no_dashboard_head():
    """ray.init without Ray's dashboard head process. With include_dashboard=False ray.init still starts it (a
    Python process that loads only Ray's usage-stats module) and waits until it has written its address, before it
    starts the raylet (Ray 2.60's services.start_api_server). A cluster that orlhf starts and ends needs none of
    what it serves (the dashboard, the job-submission and state APIs); a cluster orlhf joins keeps its own."""
    from ray._private.node import Node

    original = Node.start_api_server
    Node.start_api_server = lambda self, **kwargs: None  # self._webui_url stays None: no dashboard
    try:
        yield
    finally:
        Node.start_api_server = original


@contextmanager
def local_cluster_without(**fields):
    """ray.init's local cluster with RayParams `fields` set: ray.init builds its RayParams itself and has no switch
    for these two Ray processes, which a cluster this run starts and ends does not need without --verbose (ray
    2.60's node.py; Ray's own test clusters start nodes without a log monitor too):
    - no_monitor=True: the autoscaler monitor resizes clusters launched from an
      autoscaler config; a one-machine cluster has nothing to resize (placement groups are scheduled by the GCS,
      and a placement that cannot fit fails with orlhf's own message); its events reach only a log_to_driver run.
    - include_log_monitor=False: the log monitor forwards workers' output to a driver started with
      log_to_driver, and nothing else reads it; without --verbose workers write to <save_path>/logs instead.
    A cluster orlhf joins (--address, RAY_ADDRESS, `ray job submit`) is never touched."""
    from ray._private import parameter

    original = parameter.RayParams.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for name, value in fields.items():
            setattr(self, name, value)

    parameter.RayParams.__init__ = init
    try:
        yield
    finally:
        parameter.RayParams.__init__ = original
