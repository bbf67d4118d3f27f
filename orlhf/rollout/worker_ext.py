"""A vLLM worker extension: receives the trainer's weights and loads them in place.

vLLM instantiates this as a mixin of its Worker (`worker_extension_cls`), so `self` is the worker: it has
`self.device`, `self.rank` (TP rank) and `reload_weights`. Method names carry an `orlhf_` prefix because
Worker attributes must not be shadowed (`update_weights` is taken).

Loading goes through `reload_weights(..., is_checkpoint_format=True)`, never model.load_weights: on CPU oneDNN
repacks linear weights after the first load and a second load_weights fails (../shared/STACK.md). Each call
must hold whole layers; the sender groups tensors so.
"""

from __future__ import annotations

from datetime import timedelta

import torch

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16)}


class WeightSyncExtension:
    def orlhf_init_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                              timeout_s: float = 300.0) -> int:
        """Join the trainer -> engines group as rank `rank_offset + tp rank`. Returns that rank."""
        rank = rank_offset + self.rank
        if backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
            self._orlhf_comm = PyNcclCommunicator(group, device=self.device)
        else:
            from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

            store = TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
            self._orlhf_comm = ProcessGroupGloo(PrefixStore("orlhf-sync", store), rank, world_size,
                                                timedelta(seconds=timeout_s))
        self._orlhf_backend = backend
        return rank

    def orlhf_receive_weights(self, metas: list[tuple[str, str, tuple]], buckets: list[list[int]]) -> int:
        """Receive every bucket broadcast by the trainer (rank 0) and load it. Returns the tensors loaded.

        metas[i] = (hf_name, dtype, shape) in the sender's order; buckets = lists of indices into metas, each
        holding whole layers, in the order the sender broadcasts them.
        """
        model_dtype = self.model_config.dtype
        loaded = 0
        for bucket in buckets:
            weights = []
            for i in bucket:
                name, dtype, shape = metas[i]
                t = torch.empty(tuple(shape), dtype=_DTYPES[dtype], device=self.device)
                self._orlhf_broadcast(t)
                weights.append((name, t.to(model_dtype) if t.dtype != model_dtype else t))
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            loaded += len(weights)
        return loaded

    def orlhf_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load tensors handed over directly (same process / IPC-rebuilt). Whole layers per call."""
        model_dtype = self.model_config.dtype
        self.reload_weights(weights_iterator=[(n, t.to(self.device, model_dtype)) for n, t in weights],
                            is_checkpoint_format=True)
        return len(weights)

    def _orlhf_broadcast(self, t: torch.Tensor) -> None:
        if self._orlhf_backend == "nccl":
            self._orlhf_comm.broadcast(t, src=0, stream=torch.cuda.current_stream())
        else:
            self._orlhf_comm.broadcast(t, 0).wait()
