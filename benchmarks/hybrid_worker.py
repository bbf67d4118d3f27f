"""The actor of a DeepSpeed-Chat-style hybrid engine: orlhf's PolicyWorker generating from its own ZeRO-3 engine with
HF `generate` (no vLLM, no weight sync). Used by hybrid_engine_baseline.py (this folder); benchmark code, not part of
the orlhf package. Sampling, seeds, log-probs and cutting are orlhf's in-trainer rollout backend's
(orlhf/workers/generation.py, --rollout_backend trainer); this file adds the ways of reaching the ZeRO-3 parameters
the baseline compares:

    whole       GatheredParameters over the whole model for the call, ZeRO-3's hooks off meanwhile: orlhf's backend
                as it is (DeepSpeed's hybrid engine with pin_parameters=True does the same); ranks generate
                independently (no collectives inside).
    per_layer   no gather: ZeRO-3's hooks fetch each layer on every decode step (DeepSpeed-Chat without the
                hybrid engine); collective, so ranks run in lockstep (synced_gpus) until all are done.
    hybrid_engine=True  DeepSpeed's own DeepSpeedHybridEngine ("hybrid_engine": {"enabled": true}) and its
                `engine.generate` (inference kernels; CUDA only in practice).

Invariant: every rank calls generate() once per step (the collectives of all three modes need equal call counts).
"""

from __future__ import annotations

import torch

from orlhf.config.worker_config import WorkerConfig
from orlhf.types import Rollout, SamplingSpec
from orlhf.workers import generation
from orlhf.workers.policy import PolicyWorker

GATHER_MODES = ("whole", "per_layer")


class HybridPolicyWorker(PolicyWorker):
    """PolicyWorker + generate(). Everything else (log_probs, train_step) is the orlhf actor's, unchanged."""

    def __init__(
        self, cfg: WorkerConfig, gather: str = "whole", hybrid_engine: bool = False, max_out_tokens: int = 512
    ):
        if gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
        super().__init__(cfg)
        self.gather, self.hybrid_engine, self.max_out_tokens = gather, hybrid_engine, max_out_tokens

    def deepspeed_config(self) -> dict:
        """orlhf's actor config; with hybrid_engine plus its section, so that deepspeed.initialize (in orlhf's
        DeepSpeedWorker.init, unchanged) returns a DeepSpeedHybridEngine: the same training path, plus generate()
        on injected inference kernels."""
        config = super().deepspeed_config()
        if not self.hybrid_engine:
            return config
        return {
            **config,
            "hybrid_engine": {
                "enabled": True,
                "max_out_tokens": self.max_out_tokens,
                "inference_tp_size": 1,
                "release_inference_cache": False,
                "pin_parameters": True,
                "tp_gather_partition_size": 8,
            },
        }

    @torch.no_grad()
    def generate(
        self, prompts: list[tuple[int, list[int]]], spec: SamplingSpec, pad_id: int, eos_id: int
    ) -> list[Rollout]:
        """prompts: (prompt_index, token ids). Returns spec.n rollouts per prompt, in the given order."""
        if not prompts:
            raise ValueError("generate() needs at least one prompt on every rank (collective under ZeRO-3)")
        if self.hybrid_engine:
            return generation.rollouts(self, prompts, spec, pad_id, eos_id, generate=self.engine.generate, gather=False)
        if self.gather == "per_layer":
            synced = self.zero3 and self.world_size > 1

            def generate(**kwargs):
                return self.module.generate(**kwargs, synced_gpus=synced)

            return generation.rollouts(self, prompts, spec, pad_id, eos_id, generate=generate, gather=False)
        return generation.rollouts(self, prompts, spec, pad_id, eos_id)
