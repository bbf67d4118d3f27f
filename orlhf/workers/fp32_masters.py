"""A bf16 trained model's fp32 master weights, seeded from the checkpoint's own values where it holds more than bf16.

With --bf16 the model is loaded in bfloat16 and DeepSpeed makes its fp32 master weights from those bf16 values: a
checkpoint saved in float32 (or float16) reaches the optimizer already rounded to bf16's 8-bit mantissa, every master
exactly on a bf16 value. The weights the model computes with (and the engines sample with) are the masters rounded
to bf16 after each step, so an update moves them only once the master has drifted past half a bf16 step from where
it started. From a rounded start that takes many updates at RL's learning rates: on SmolLM2-135M at 1e-5 the median
weight needs about 24 Adam steps of one sign before its bf16 value changes at all, and a run of the real-model recipe
learned almost nothing in 10 steps where fp32 went from 10% to 80% held-out accuracy in 5. Seeded with the
checkpoint's fp32 values, the masters sit where the model was trained to, between bf16 values; small updates then
move the bf16 weights of those near a rounding boundary, in the update's direction, so the bf16 model follows the
masters on average as the fp32 one does (benchmarks/results/2026-12-02-bf16-real-model.md).

    seed_fp32_masters(engine, model_path) -> (seeded, total)   after deepspeed.initialize, every rank

Read tensor by tensor from the folder's safetensors files (no second model in memory); a parameter is seeded when
the checkpoint has it under the module's own parameter name in float32 or float16 (bf16 checkpoints have nothing
more to give; names the runtime model fuses or renames keep DeepSpeed's rounded masters). Under ZeRO-3 each rank
writes its own partition of each (DeepSpeed's safe_set_full_fp32_param, which reaches ZeRO-1/2's and BF16_Optimizer's
masters too); without ZeRO, DeepSpeed's unfused optimizer's per-parameter copies. A resumed run loads its saved
masters over these afterwards.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WIDER_THAN_BF16 = ("F32", "F16", "F64")  # safetensors dtype names whose values bf16 rounds


def seed_fp32_masters(engine, model_path: str) -> tuple[int, int]:
    """Set each trained parameter's fp32 master to the checkpoint's value where the checkpoint holds it wider than
    bf16. Returns (parameters seeded, trained parameters)."""
    from deepspeed.utils import safe_set_full_fp32_param

    files = sorted(Path(model_path).glob("*.safetensors"))
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if not files:
        log.info("bf16: %s has no safetensors files: the fp32 master weights start from the bf16 ones", model_path)
        return 0, len(params)
    from safetensors import safe_open

    wanted = dict(params)
    unfused = _unfused_masters(engine.optimizer)
    seeded = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                p = wanted.get(name)
                if p is None or sf.get_slice(name).get_dtype() not in WIDER_THAN_BF16:
                    continue
                value = sf.get_tensor(name).to(device=p.device, dtype=torch.float32)
                if tuple(value.shape) != tuple(getattr(p, "ds_shape", p.shape)):
                    continue
                if _has_master(p):
                    safe_set_full_fp32_param(p, value)
                elif id(p) in unfused:
                    unfused[id(p)].data.copy_(value)
                else:
                    continue
                seeded += 1
    return seeded, len(params)


def _has_master(p: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed keeps an fp32 master for p that safe_set_full_fp32_param reaches (ZeRO-3, or the ZeRO-1/2
    and BF16_Optimizer link)."""
    return hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None


def _unfused_masters(optimizer) -> dict[int, torch.Tensor]:
    """{id(bf16 parameter): its fp32 master} of DeepSpeed's FP16_UnfusedOptimizer, which bf16 without ZeRO gets
    (gradients accumulated in bf16): per-parameter fp32 copies (fp32_groups) beside the model's (fp16_groups), which
    safe_set_full_fp32_param does not reach."""
    low, high = getattr(optimizer, "fp16_groups", None) or [], getattr(optimizer, "fp32_groups", None) or []
    return {
        id(lp): hp
        for lg, hg in zip(low, high)
        for lp, hp in zip(lg, hg)
        if isinstance(hp, torch.Tensor) and hp.shape == lp.shape
    }
