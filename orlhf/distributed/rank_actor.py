"""RankActor: the Ray actor that holds one rank's worker in a process of its own, and where that process's output goes.

It sets the rank's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) before the worker exists, sends the
process's output to the run's logs (storage/logs.py: actor-0.log, critic-1.log, vllm-0.log), pins the network
interface peers reach it on (distributed/addresses.py), and runs the worker's methods by name on Ray's pool threads.
distributed/groups.py's ActorGroup starts one per rank and calls it; a platform may give a group another actor
class with the same remote methods (distributed/tuning.py; on CPU orlhf/cpu/rank_actor.py).
"""

from __future__ import annotations

import os
from typing import Any

import ray

from orlhf.distributed import addresses
from orlhf.distributed.heartbeat import HEALTH, HEALTH_GROUPS
from orlhf.storage.import_tables import install as install_import_tables
from orlhf.storage.logs import redirect_output


def log_name(role: str, rank: int) -> str:
    """The log file name (storage/logs.py) of a rank or engine: actor-0, critic-1, vllm-0."""
    return f"{'vllm' if role.startswith('vllm') else role}-{rank}"


@ray.remote(concurrency_groups=HEALTH_GROUPS)
class RankActor:
    """Holds one rank's worker and runs its methods by name, on Ray's pool threads; no logic of its own. A
    platform may give a group another actor class with these remote methods (distributed/tuning.py)."""

    def __init__(self, role: str, rank: int, env: dict[str, str]):
        install_import_tables()  # before setup's worker class imports transformers (storage/import_tables.py)
        os.environ.update(env)
        redirect_output(log_name(role, rank))
        addresses.pin()  # before DeepSpeed or NCCL start: they read the interface it exports
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """(ip, free port) this rank's peers reach it at (distributed/addresses.py): rank 0's becomes the group's
        rendezvous address."""
        return addresses.local_address(), addresses.free_port()

    def setup(self, worker_cls: type, cfg: Any, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.worker = worker_cls(cfg)

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    @ray.method(concurrency_group=HEALTH)
    def pid(self) -> int:
        """Also the health check (distributed/heartbeat.py): its own thread, beside any call."""
        return os.getpid()
