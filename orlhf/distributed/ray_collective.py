"""The trainer -> engines weight-sync group through Ray's collective library (ray.util.collective), for
--vllm_sync_with_ray (OpenRLHF's flag of the same name): members meet by the group's name through Ray, not at an
address handed around, and every tensor crosses with collective.broadcast.

    join(group, rank, world_size, backend, device, timeout_s)   each member: actor rank 0 (rank 0), each engine worker
    broadcast(t, group)                                          rank 0 sends t; the others receive into t
    leave(group)                                                 drop this process's end of the group

NCCL is Ray's own backend (cupy's NCCL; rank 0 leaves the NCCL id in a named Ray actor). Ray's GLOO backend cannot
serve here: it builds its group out of torch.distributed's default group (dist.new_group over it), and both ends
already have a default group of other processes (DeepSpeed's in the actor rank, vLLM's in the engine worker), so
joining fails ("the new group's world size should be less or equal to the world size set by init_process_group").
For gloo, orlhf registers a backend of its own with Ray's collective library (STATELESS_GLOO below): rank 0
publishes its host:port in Ray's internal KV store under the group's name, as Ray's GLOO does, and the members build
a ProcessGroupGloo over a TCPStore there, outside the default group.

Every call needs a Ray worker process (ray.util.collective refuses any other): the actor ranks are Ray actors, and
the engines' vLLM workers are Ray workers when the engine core runs in the engine actor's process (rollout/engine.py).
A group name is used once: a fresh group gets a fresh name (rollout/weight_sync.py), so no member can meet a stale
address or a group Ray still holds.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

STATELESS_GLOO = "ORLHF_STATELESS_GLOO"
_KV_PREFIX = "orlhf_collective_address_"
_timeouts: dict[str, float] = {}  # group name -> seconds, read by the group as Ray builds it (its constructor
# takes no timeout for a registered backend)


def join(group: str, rank: int, world_size: int, backend: str, device: torch.device, timeout_s: float) -> None:
    """Join `group` as `rank`, and return once every member has: a one-element broadcast (on `device` for NCCL)
    makes the group whole here (Ray's NCCL connects on the first collective), so a member that cannot join fails
    the join, not a sync."""
    from ray.util import collective

    if backend == "gloo":
        _register()
        _timeouts[group] = timeout_s
        name = STATELESS_GLOO
    else:
        name = "nccl"
    try:
        collective.init_collective_group(world_size, rank, backend=name, group_name=group)
    finally:
        _timeouts.pop(group, None)
    broadcast(torch.zeros(1, device=device if backend == "nccl" else "cpu"), group)


def broadcast(t: torch.Tensor, group: str) -> None:
    """Rank 0's t to every member, in place. On a GPU, synchronous with the calling stream on both sides: Ray's
    NCCL runs on a stream of its own, which would otherwise not wait for t to be written (sender) nor make the
    reader wait for it to arrive (receiver), and the sender's t may be freed as soon as this returns."""
    from ray.util import collective

    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
    collective.broadcast(t, 0, group_name=group)
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def leave(group: str) -> None:
    """Drop this process's end of `group` (nothing when it holds none). Rank 0's leaving closes the gloo store,
    which fails the receives still waiting in the group."""
    from ray.util import collective

    if collective.is_group_initialized(group):
        collective.destroy_collective_group(group)


def _register() -> None:
    from ray.util.collective import is_backend_available
    from ray.util.collective.backend_registry import register_collective_backend

    if not is_backend_available(STATELESS_GLOO):
        try:
            register_collective_backend(STATELESS_GLOO, _stateless_gloo_class())
        except ValueError:  # another thread of this process registered it meanwhile
            pass


def _stateless_gloo_class():
    """Built on first use: Ray's BaseGroup is imported only in processes that sync through Ray."""
    from ray.util.collective.collective_group.base_collective_group import BaseGroup

    class StatelessGlooGroup(BaseGroup):
        """A gloo group of its own (TCPStore + ProcessGroupGloo), met through Ray's KV store; broadcast only."""

        def __init__(self, world_size: int, rank: int, group_name: str):
            import ray.experimental.internal_kv as kv
            from torch.distributed import PrefixStore, TCPStore

            from orlhf.distributed.addresses import free_port, gloo_group, local_address, reach

            super().__init__(world_size, rank, group_name)
            timeout = timedelta(seconds=_timeouts.get(group_name, 300.0))
            key = _KV_PREFIX + group_name
            if rank == 0:
                host, port = local_address(), free_port()
                self._store = TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
                kv._internal_kv_put(key, f"{host}:{port}")
            else:
                host, port = _wait_for_address(kv, key, group_name, timeout.total_seconds())
                reach(host, port, f"the store of Ray collective group {group_name}", timeout.total_seconds())
                self._store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            # connects to every member: returns once all have joined
            self._pg = gloo_group(PrefixStore(group_name, self._store), rank, world_size, timeout)
            if rank == 0:
                kv._internal_kv_del(key)

        @classmethod
        def backend(cls):
            return STATELESS_GLOO

        @classmethod
        def check_backend_availability(cls) -> bool:
            return True

        def broadcast(self, tensor, broadcast_options=None):
            root = broadcast_options.root_rank if broadcast_options is not None else 0
            self._pg.broadcast(tensor[0], root).wait()

        def destroy_group(self):
            self._pg = self._store = None

        def _only_broadcast(self, *args, **kwargs):
            raise NotImplementedError("orlhf's weight-sync group only broadcasts")

        allreduce = barrier = reduce = allgather = reducescatter = send = recv = _only_broadcast

    return StatelessGlooGroup


def _wait_for_address(kv, key: str, group: str, timeout_s: float) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while (value := kv._internal_kv_get(key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"weight-sync group {group}: rank 0 did not publish its address within {timeout_s:.0f} s"
            )
        time.sleep(0.05)
    host, _, port = value.decode().rpartition(":")
    return host, int(port)
