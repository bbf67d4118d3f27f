"""The trainer ranks' side of a weight sync: runs inside the actor's rank processes (PolicyWorker).

    broadcast (NCCL | gloo):  rank 0 owns a WeightSender (its end of the trainer -> engines group: a stateless
                              torch/vLLM group, or with --vllm_sync_with_ray a Ray collective group,
                              distributed/ray_collective.py); every rank walks the gathered ZeRO-3 groups
                              (send_groups: a collective), rank 0 broadcasts; with --vllm_sync_delta rank 0
                              broadcasts what changed since the last sync instead (send_groups_delta, codec in
                              workers/weight_delta.py), against the engine-dtype copy it keeps (WeightSender.held)
    CUDA IPC (colocated GPU): send_ipc: every rank gathers each group and makes IPC handles of its own copy;
                              the first rank of each TP group has its engine load them

The driver's side (set-up, order, waits) is orlhf/rollout/weight_sync.py; the engines' side is rollout/worker_ext.py.
The store timeout (`timeout_s`) bounds how long rank 0 waits for the engine workers to join.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Iterable, Optional

import torch


class WeightSender:
    """Lives in actor rank 0's process: owns its end of the trainer -> engines group and broadcasts."""

    def __init__(
        self,
        host: Optional[str],
        port: Optional[int],
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float = 300.0,
        ray_group: Optional[str] = None,
    ):
        """ray_group: join that Ray collective group (--vllm_sync_with_ray; host and port unused); else host the
        group's store at host:port."""
        self.backend, self.device, self.ray_group, self.comm = backend, device, ray_group, None
        self.held: dict[str, torch.Tensor] = {}  # --vllm_sync_delta: what the engines hold, in their dtype
        if ray_group is not None:
            from orlhf.distributed.ray_collective import join

            join(ray_group, 0, world_size, backend, device, timeout_s)
        elif backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
            self.comm = PyNcclCommunicator(group, device=device)
        else:
            from torch.distributed import PrefixStore, TCPStore

            from orlhf.distributed.addresses import gloo_group

            store = TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s))
            self.comm = gloo_group(PrefixStore("orlhf-sync", store), 0, world_size, timedelta(seconds=timeout_s))

    def broadcast(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        if self.ray_group is not None:
            from orlhf.distributed.ray_collective import broadcast

            broadcast(t.to(self.device) if self.backend == "nccl" else t, self.ray_group)
        elif self.backend == "nccl":
            self.comm.broadcast(t.to(self.device), src=0, stream=torch.cuda.current_stream())
        else:
            self.comm.broadcast(t, 0).wait()

    def close(self) -> None:
        """Drop this end of the group; the engine workers still waiting in it fail out. A stateless group goes with
        its last reference; a Ray group is held by Ray's group manager until left."""
        if self.ray_group is not None:
            from orlhf.distributed.ray_collective import leave

            leave(self.ray_group)
            self.ray_group = None
        self.comm = None


def send_groups(
    sender: Optional[WeightSender], groups: Iterable[list[tuple[str, Optional[torch.Tensor]]]], expected: int
) -> int:
    """Walk the worker's gathered groups (all ranks must) and broadcast them from rank 0 (sender not None).

    Returns the number of tensors broadcast (0 on ranks > 0). A broadcast that fails (an engine died) stops the
    broadcasting, not the walk: the other ranks gather each group with this one (a collective), and would wait
    for it forever. Raised after the walk, as its message only, so nothing keeps the failed group alive.
    """
    sent, failed = 0, None
    for group in groups:
        if sender is None:
            continue
        for _, t in group:
            if failed is None:
                try:
                    sender.broadcast(t)
                except RuntimeError as e:
                    failed = str(e)
            sent += 1
    if failed is not None:
        raise RuntimeError(f"the weight broadcast to the engines failed: {failed}")
    if sender is not None and sent != expected:
        raise RuntimeError(
            f"sent {sent} tensors but the engines expect {expected}: the parameter list changed "
            "between planning and sending"
        )
    return sent


def send_groups_delta(
    sender: Optional[WeightSender],
    groups: Iterable[list[tuple[str, Optional[torch.Tensor]]]],
    bucket_sizes: list[int],
    dtype: torch.dtype,
    full: bool,
) -> int:
    """--vllm_sync_delta: walk the gathered groups as send_groups does (all ranks), and from rank 0 broadcast per
    bucket (bucket_sizes: tensors per bucket, in order) the changes since the last sync against sender.held, each
    tensor cast to the engines' `dtype` (workers/weight_delta.py: codes, indices, masks, values), diffed on the
    host (the held copy lives in host memory; the broadcast moves the parts to the group's device). full: every tensor
    whole, held rebuilt (the first sync, and after a replaced engine or a failed sync). Returns the bytes rank 0
    broadcast (0 on other ranks). A failed broadcast ends the broadcasting, not the walk (see send_groups); the
    held copy is then stale, so the driver's next sync is a full one."""
    from orlhf.workers.weight_delta import encode_bucket

    if sender is None:
        for _ in groups:
            pass
        return 0
    if full:
        sender.held = {}
    sent_bytes, failed, names, news, extra = 0, None, [], [], 0
    sizes = list(bucket_sizes)
    for group in groups:
        for name, t in group:
            if not sizes:
                extra += 1
                continue
            names.append(name)
            news.append(t.to("cpu", dtype, copy=True))  # held in host memory: no trainer GPU memory
            if len(names) < sizes[0]:
                continue
            sizes.pop(0)
            parts = encode_bucket(news, [sender.held.get(n) for n in names])  # codes, indices, masks, values
            sender.held.update(zip(names, news))
            names, news = [], []
            for part in parts:
                if part.numel() and failed is None:
                    try:
                        sender.broadcast(part)
                        sent_bytes += part.numel() * part.element_size()
                    except RuntimeError as e:
                        failed = str(e)
    if failed is not None:
        raise RuntimeError(f"the weight broadcast to the engines failed: {failed}")
    if names or sizes or extra:
        raise RuntimeError(
            f"{len(names) + extra} tensors left over and {len(sizes)} buckets unsent: the parameter list changed "
            "between planning and sending"
        )
    return sent_bytes


def device_uuid(device: torch.device) -> str:
    """The physical GPU's UUID: the same string in every process, whatever its CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


def make_ipc_handles(named: list[tuple[str, torch.Tensor]], uuid: str) -> dict[str, dict[str, tuple]]:
    """{gpu uuid: {name: (rebuild function, args)}} for tensors that stay alive until the receiver is done.

    Keyed by the GPU's UUID because vLLM gives TP rank k the k-th lowest physical GPU of its bundles, which need
    not be the GPU of trainer rank i*TP+k: each engine worker picks the handles made on its own GPU.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    return {uuid: {name: reduce_tensor(t) for name, t in named}}


def merge_handles(parts: list[dict[str, dict[str, tuple]]]) -> dict[str, dict[str, tuple]]:
    """One {uuid: handles} dict from the TP peers' dicts; two peers on one GPU would be a placement bug."""
    merged: dict[str, dict[str, tuple]] = {}
    for part in parts:
        for uuid, handles in part.items():
            if uuid in merged:
                raise RuntimeError(
                    f"two trainer ranks of one engine sit on GPU {uuid}; CUDA IPC sync needs one "
                    "trainer rank per engine GPU"
                )
            merged[uuid] = handles
    return merged


def send_ipc(worker, engine, tp: int) -> int:
    """Actor-rank side of IpcWeightSync (runs inside PolicyWorker.send_weights_ipc, every rank).

    The TP group's first rank opens one layerwise reload on its engine (orlhf_ipc_begin), then per parameter
    group: all ranks gather it (collective), each clones its full copy and makes CUDA IPC handles keyed by its
    GPU's UUID; the first rank collects its TP peers' handles and has its engine load them (the engine copies
    and synchronizes before returning); a barrier keeps every clone alive until all engines are done with the
    group. Finally the engine finishes the reload (orlhf_ipc_finish): one reload per sync, not one per layer.
    """
    import torch.distributed as dist

    # `engine`: an EngineGroup of this rank's one engine (EngineGroup.subset); its ipc_* methods call the engine's
    # vLLM workers (rollout/worker_ext.py), so this layer needs no import of the rollout layer above it
    leader = worker.rank % tp == 0
    if leader:
        engine.ipc_begin()
    uuid = device_uuid(worker.device)
    sent = 0
    for group in worker.sync_groups(to_cpu=False, copy=True, all_ranks=True):
        gathered: list = [None] * worker.world_size
        dist.all_gather_object(gathered, make_ipc_handles(group, uuid))
        if leader:
            merged = merge_handles(gathered[worker.rank : worker.rank + tp])
            engine.load_ipc([n for n, _ in group], merged)
        dist.barrier()
        sent += len(group)
    if leader:
        engine.ipc_finish()
    return sent
