"""The only code that moves weights from the trainer (actor ranks) to the vLLM engines.

    driver: WeightSync.sync(version)
      1. engines: orlhf_receive_weights(metas, buckets)  (async; each engine worker blocks in broadcast)
      2. actor ranks: send_weights(n tensors)            (all ranks gather each ZeRO-3 layer; rank 0 broadcasts)
      3. wait for both, then engines: reset_prefix_cache, set_weight_version(version)

Invariants:
- Called after the actor's optimizer step has returned on every rank and before the next generate: the
  controller's step() is sync -> generate, never both in flight (async mode holds a lock around it).
- Every actor rank walks the same parameter groups in the same order: ZeRO-3's GatheredParameters is a
  collective, so a rank that skipped a group would hang the others. Only rank 0 owns the sync group.
- A bucket holds whole layers (the worker yields one group per decoder layer, plus one for the rest); vLLM's
  reload_weights gives a wrong model when a layer is split across calls (../shared/STACK.md). Engines load a
  whole sync in one reload_weights call and use buckets as their receive-ahead window (worker_ext.py).
- The engines reset their prefix cache after loading: cached KV blocks hold activations of the old weights.
- dtypes: the trainer sends its own dtype (fp32, or bf16 with --bf16); engines cast to theirs on receipt.
- Names: tensors leave the trainer as a checkpoint on disk names them (workers/hf_names.py: transformers' fused
  runtime tensors split back per expert), on every path; engines load them through one reload wrapper that
  refreshes what vLLM's reload leaves stale (rollout/reload_fixes.py: tied heads, pre-packed MoE experts).
- Backend: gloo on CPU (a stateless TCPStore + ProcessGroupGloo next to DeepSpeed's default group), NCCL on
  GPUs (vLLM's PyNcclCommunicator over a StatelessProcessGroup). Colocated on one GPU (--colocate_all_models),
  CUDA IPC handles replace the broadcast (IpcWeightSync): engine e's TP workers share GPUs with actor ranks
  [e*TP, (e+1)*TP), so each rank hands handles to its own gathered copy of each layer, keyed by GPU UUID (each
  engine worker picks its own GPU's); the engine copies them and synchronizes before returning, and the layer is
  freed only after every engine of the step loaded it (a barrier). Per layer, so the extra memory is one layer;
  one layerwise reload spans the whole sync (begin, one load per layer, finish).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Iterable, Optional

import torch

log = logging.getLogger(__name__)

Meta = tuple[str, str, tuple]  # (hf name, dtype as str, full shape)


def plan_buckets(groups: list[list[Meta]], bucket_bytes: int) -> tuple[list[Meta], list[list[int]]]:
    """Flatten groups of tensors into metas and pack whole groups into buckets of about bucket_bytes.

    A group larger than bucket_bytes gets a bucket of its own (a layer is never split).
    """
    metas: list[Meta] = []
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for group in groups:
        nbytes = sum(_nbytes(m) for m in group)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        for m in group:
            current.append(len(metas))
            metas.append(m)
        size += nbytes
    if current:
        buckets.append(current)
    return metas, buckets


def _nbytes(meta: Meta) -> int:
    _, dtype, shape = meta
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=getattr(torch, dtype.replace("torch.", ""))).element_size()


class WeightSender:
    """Lives in actor rank 0's process: owns its end of the trainer -> engines group and broadcasts."""

    def __init__(self, host: str, port: int, world_size: int, backend: str, device: torch.device,
                 timeout_s: float = 300.0):
        self.backend, self.device = backend, device
        if backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size)
            self.comm = PyNcclCommunicator(group, device=device)
        else:
            from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

            store = TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s))
            self.comm = ProcessGroupGloo(PrefixStore("orlhf-sync", store), 0, world_size,
                                         timedelta(seconds=timeout_s))

    def broadcast(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        if self.backend == "nccl":
            self.comm.broadcast(t.to(self.device), src=0, stream=torch.cuda.current_stream())
        else:
            self.comm.broadcast(t, 0).wait()


def send_groups(sender: Optional[WeightSender], groups: Iterable[list[tuple[str, Optional[torch.Tensor]]]],
                expected: int) -> int:
    """Walk the worker's gathered groups (all ranks must) and broadcast them from rank 0 (sender not None).

    Returns the number of tensors broadcast (0 on ranks > 0).
    """
    sent = 0
    for group in groups:
        if sender is None:
            continue
        for _, t in group:
            sender.broadcast(t)
            sent += 1
    if sender is not None and sent != expected:
        raise RuntimeError(f"sent {sent} tensors but the engines expect {expected}: the parameter list changed "
                           "between planning and sending")
    return sent


class WeightSync:
    """Driver side: sets up the group once, then pushes the actor's weights into every engine per update."""

    def __init__(self, actor, engines, backend: str, bucket_mb: float = 256.0, timeout_s: float = 600.0):
        from orlhf.cluster import wait_all

        self._wait = wait_all
        self.actor, self.engines, self.backend, self.timeout_s = actor, engines, backend, timeout_s
        groups = actor.call_rank(0, "weight_groups_meta")
        self.metas, self.buckets = plan_buckets(groups, int(bucket_mb * 2**20))
        tp = engines.cfg.tensor_parallel_size
        world = 1 + len(engines) * tp
        host, port = actor.call_rank(0, "sync_address")
        actor_ref = actor.actors[0].call.remote("init_weight_sender", host, port, world, backend, timeout_s)
        engine_refs = [e.collective_rpc.remote("orlhf_init_sync_group",
                                               (host, port, 1 + i * tp, world, backend, timeout_s))
                       for i, e in enumerate(engines.engines)]
        self._wait_both([actor_ref], engine_refs, "init sync group")
        log.info("weight sync: %s group of %d (1 trainer + %d engine workers), %d tensors in %d buckets",
                 backend, world, world - 1, len(self.metas), len(self.buckets))

    def sync(self, version: int) -> float:
        """Push the current actor weights into every engine; returns the seconds it took."""
        t0 = time.perf_counter()
        engine_refs = [e.collective_rpc.remote("orlhf_receive_weights", (self.metas, self.buckets))
                       for e in self.engines.engines]
        actor_refs = [a.call.remote("send_weights", len(self.metas)) for a in self.actor.actors]
        self._wait_both(actor_refs, engine_refs, "sync weights")
        self.engines.call_all("reset_prefix_cache")
        self.engines.call_all("set_weight_version", version)
        return time.perf_counter() - t0

    def _wait_both(self, actor_refs: list, engine_refs: list, what: str) -> None:
        # Wait on both sides together: if one side fails the other is stuck in a broadcast, so fail fast.
        refs = actor_refs + engine_refs
        ranks = list(range(len(actor_refs))) + [f"engine {i}" for i in range(len(engine_refs))]
        self._wait(refs, ranks, "weight sync (actor / vllm engines)", what, self.timeout_s)


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
                raise RuntimeError(f"two trainer ranks of one engine sit on GPU {uuid}; CUDA IPC sync needs one "
                                   "trainer rank per engine GPU")
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
    import ray
    import torch.distributed as dist

    leader = worker.rank % tp == 0
    if leader:
        ray.get(engine.collective_rpc.remote("orlhf_ipc_begin"))
    uuid = device_uuid(worker.device)
    sent = 0
    for group in worker.named_full_weights(to_cpu=False, copy=True, all_ranks=True):
        gathered: list = [None] * worker.world_size
        dist.all_gather_object(gathered, make_ipc_handles(group, uuid))
        if leader:
            merged = merge_handles(gathered[worker.rank:worker.rank + tp])
            ray.get(engine.collective_rpc.remote("orlhf_load_ipc", ([n for n, _ in group], merged)))
        dist.barrier()
        sent += len(group)
    if leader:
        ray.get(engine.collective_rpc.remote("orlhf_ipc_finish"))
    return sent


class IpcWeightSync:
    """Driver side for --colocate_all_models on GPUs: no broadcast, CUDA IPC handles on each shared GPU."""

    def __init__(self, actor, engines, timeout_s: float = 600.0):
        from orlhf.cluster import wait_all

        self.actor, self.engines, self.timeout_s, self._wait = actor, engines, timeout_s, wait_all
        tp = engines.cfg.tensor_parallel_size
        if actor.world_size != len(engines) * tp:
            raise ValueError(f"CUDA IPC sync needs one engine worker per actor rank ({actor.world_size} actor "
                             f"ranks, {len(engines)} engines x TP {tp})")
        refs = [a.call.remote("init_ipc_sync", engines.engines[r // tp], tp) for r, a in enumerate(actor.actors)]
        self._wait(refs, list(range(actor.world_size)), "actor", "init_ipc_sync", timeout_s)
        log.info("weight sync: CUDA IPC on %d shared GPUs", actor.world_size)

    def sync(self, version: int) -> float:
        t0 = time.perf_counter()
        self.actor.call_all("send_weights_ipc")
        self.engines.call_all("reset_prefix_cache")
        self.engines.call_all("set_weight_version", version)
        return time.perf_counter() - t0


def make_weight_sync(cfg, actor, engines):
    """CUDA IPC when every engine shares its GPUs with actor ranks, else a broadcast group (NCCL | gloo)."""
    if cfg.placement.colocate_all_models and cfg.runtime.device == "cuda":
        return IpcWeightSync(actor, engines, cfg.runtime.ray_timeout_s)
    return WeightSync(actor, engines, cfg.vllm.sync_backend, cfg.vllm.sync_bucket_mb, cfg.runtime.ray_timeout_s)
