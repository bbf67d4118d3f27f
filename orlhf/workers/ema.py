"""--enable_ema: an exponential moving average of the actor's trained weights, in host memory.

    after each optimizer step:  avg = beta * avg + (1 - beta) * w for every trained parameter, as OpenRLHF's
                                moving_average: under ZeRO-3 each parameter is gathered for it (a collective: every
                                rank calls update(); rank 0 keeps the average, in the parameter's dtype)
    exports (final, --save_hf_ckpt): the trained entries of the exported state are the averages (as OpenRLHF exports
                                its EMA model); weight syncs always send the trained weights (the engines sample from
                                the policy being trained)
    checkpoints:                state() / load() on rank 0, so a resume continues the average

The average starts from the weights at start-up (--pretrain, as OpenRLHF's EMA model loads it). With LoRA the trained
parameters are the adapter's, so the average is an adapter too. Rank 0 holds the whole average where OpenRLHF spreads
it over the ranks' host memory (a ZeRO-3 engine with offloaded parameters).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable, Optional

import torch
from torch import nn


class EmaWeights:
    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], beta: float, rank: int, zero3: bool):
        self.beta, self.rank, self.zero3 = float(beta), rank, zero3
        self.params = [(n, p) for n, p in named_params if p.requires_grad]
        self.avg: dict[str, torch.Tensor] = {}
        self._each(lambda name, full: self.avg.__setitem__(name, full.detach().to("cpu", copy=True)))

    def _each(self, fn) -> None:
        """fn(name, full tensor) on rank 0 for every trained parameter; the gathers are collective."""
        import deepspeed

        for name, p in self.params:
            with deepspeed.zero.GatheredParameters([p]) if self.zero3 else nullcontext():
                if self.rank == 0:
                    fn(name, p.data)

    @torch.no_grad()
    def update(self) -> None:
        def step(name: str, full: torch.Tensor) -> None:
            avg = self.avg[name]
            avg.mul_(self.beta).add_(full.detach().to(avg.device, avg.dtype), alpha=1.0 - self.beta)

        self._each(step)

    def averaged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (rank 0's full weights by module name) with every trained entry replaced by its average."""
        return {n: (self.avg[n].to(t.dtype) if n in self.avg else t) for n, t in state.items()}

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.avg) if self.rank == 0 else {}

    def load(self, state: Optional[dict[str, torch.Tensor]]) -> None:
        if self.rank != 0:
            return
        if state is None or set(state) != set(self.avg):
            raise ValueError(
                f"the checkpoint's EMA holds {len(state or {})} tensors, this actor trains {len(self.avg)}: written "
                "without --enable_ema, or by another model or LoRA setting"
            )
        for name, value in state.items():
            if value.shape != self.avg[name].shape:
                raise ValueError(
                    f"EMA tensor {name}: checkpoint {tuple(value.shape)}, here {tuple(self.avg[name].shape)}"
                )
            self.avg[name].copy_(value)
