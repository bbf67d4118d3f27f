"""The Ray cluster a run uses: the one it is given or runs in (--address, RAY_ADDRESS, `ray job submit`), joined as
it is, else a local one this process starts (and run_locked shuts down), without the Ray processes such a
cluster does not need (the autoscaler monitor, the log monitor, the dashboard head) unless --verbose shows their
output.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

from orlhf.config.train_config import TrainConfig
from orlhf.distributed.tuning import Tuning


def connect_ray(cfg: TrainConfig, num_cpus: int, processes: int = 0, tuning: Optional[Tuning] = None) -> bool:
    """Join the given / the job's cluster, else start a local one (`num_cpus` logical CPUs; `processes`: the
    run's model and engine processes; `tuning`'s ray_options for it, distributed/tuning.py). Returns True when
    this process started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS")
    # Workers' output goes to <save_path>/logs unless --verbose (storage/logs.py); Ray's own driver-side records then go
    # to driver.log through the root logger instead of Ray's terminal handler.
    quiet = dict(log_to_driver=cfg.runtime.verbose, configure_logging=cfg.runtime.verbose)
    if address:
        ray.init(address=address, **quiet)
        return False
    options = (tuning or Tuning()).ray_options(cfg, num_cpus, processes)
    if cfg.runtime.verbose:  # Ray's processes as ray.init starts them: their output is what --verbose shows
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet, **options)
        return True
    with local_cluster_without(no_monitor=True, include_log_monitor=False), no_dashboard_head():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet, **options)
    return True


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
