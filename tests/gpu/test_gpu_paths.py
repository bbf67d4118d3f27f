"""GPU-only paths (skipped without CUDA): NCCL broadcast sync, CUDA IPC sync in hybrid mode, sleep/wake.

These need a machine with CUDA, ray, deepspeed and the CUDA build of vLLM (the `gpu` extra); without ray or
vLLM they skip saying so (scripts/gpu_check.sh runs the Ray-free tests next to this file). The NCCL case puts
actor, reference and engine on three GPUs of their own; the hybrid case shares one. Each checks the same parity
as tests/vllm/test_engines.py: after a train step and a sync, the engine's log-probs of the rollouts match the
trainer's (both bfloat16 here, as engines on GPUs always are: mean gap <= 0.02), and that no rank or engine
process imported orlhf.cpu (a GPU run takes the plain tuning: distributed/tuning.py).
"""

import pytest
import torch
from gpu_helpers import installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.vllm,
    pytest.mark.skipif(
        not (installed("ray") and installed("vllm")),
        reason="needs ray and the CUDA build of vLLM (pip install -e .[gpu])",
    ),
]

# actor, reference and the engine each on a GPU of their own (split placement); hybrid shares one
GPUS_NEEDED = {"nccl": 3, "cuda_ipc_hybrid": 1}


def _rig(tmp_path, **flags):
    import ray

    from orlhf.config.resolve import finish_config
    from orlhf.config.worker_config import worker_config
    from orlhf.distributed.groups import ActorGroup
    from orlhf.distributed.placement import create_placement_groups
    from orlhf.launch.bringup import run_layout, tuning_for
    from orlhf.rollout.engine_config import engine_config
    from orlhf.rollout.engine_group import EngineGroup
    from orlhf.rollout.weight_sync import make_weight_sync
    from orlhf.workers import PolicyWorker

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False)
    base = {
        "train_batch_size": 8,
        "micro_train_batch_size": 8,
        "rollout_batch_size": 8,
        "device": "cuda",
        "advantage_estimator": "reinforce",
        "bf16": True,
        **flags,
    }
    cfg = finish_config(base, explicit=set(base))
    placed = create_placement_groups(run_layout(cfg), timeout_s=120)
    engines = EngineGroup(
        engine_config(cfg), [placed.engine_bundles(i) for i in range(cfg.vllm.num_engines)], tuning=tuning_for(cfg)
    )
    actor = ActorGroup(
        "actor",
        PolicyWorker,
        worker_config(cfg, "actor", 4),
        placed.role_bundles("actor"),
        device="cuda",
        timeout_s=300,
    )
    actor.call(PolicyWorker.init).get()
    return cfg, engines, actor, make_weight_sync(cfg, actor, engines)


def _cpu_modules(actor, engines) -> list[str]:
    """The orlhf.cpu modules loaded in any of the actor's rank processes or the engines' processes."""
    import ray

    def loaded(_actor) -> list[str]:
        import sys

        return [m for m in sys.modules if m == "orlhf.cpu" or m.startswith("orlhf.cpu.")]

    handles = actor.actors + engines._engines
    return sorted({m for mods in ray.get([h.__ray_call__.remote(loaded) for h in handles], timeout=120) for m in mods})


def _parity(engines, actor, tok):
    from orlhf.rollout.engine import SamplingSpec
    from orlhf.trainer.experience import rollouts_to_batch
    from orlhf.types import Experience

    prompts = [tok(f"say colors: red {'blue ' * i}")["input_ids"] for i in range(8)]
    rollouts = engines.generate(prompts, SamplingSpec(max_new_tokens=6, seed=1))
    batch, _ = rollouts_to_batch(rollouts, tok.pad_token_id)
    from orlhf.workers import PolicyWorker

    old = actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()
    actor.call_sharded(
        PolicyWorker.train_step,
        Experience(
            batch.sequences,
            batch.attention_mask,
            batch.action_mask,
            action_log_probs=old,
            advantages=torch.randn(old.shape),
        ),
    ).get()
    return rollouts, actor.call_sharded(PolicyWorker.log_probs, batch).get_cat()


@pytest.mark.parametrize(
    "flags",
    [{}, {"colocate_all_models": True, "vllm_enable_sleep": True, "deepspeed_enable_sleep": True}],
    ids=["nccl", "cuda_ipc_hybrid"],
)
def test_sync_parity_on_gpu(tmp_path, flags, request):
    from transformers import AutoTokenizer

    from orlhf.rollout.engine import EngineActor

    need = GPUS_NEEDED[request.node.callspec.id]
    if torch.cuda.device_count() < need:
        pytest.skip(
            f"needs {need} GPUs (actor, reference and engine on their own), this machine has "
            f"{torch.cuda.device_count()}"
        )
    cfg, engines, actor, sync = _rig(tmp_path, **flags)
    tok = AutoTokenizer.from_pretrained(cfg.data.pretrain)
    rollouts, new = _parity(engines, actor, tok)
    if cfg.vllm.enable_sleep:
        engines.call(EngineActor.sleep).get()
        engines.call(EngineActor.wake_up, ["weights"]).get()
    sync.sync(1)
    if cfg.vllm.enable_sleep:
        engines.call(EngineActor.wake_up, ["kv_cache"]).get()
    lps = engines.call_rank(0, EngineActor.sequence_logprobs, [r.prompt_ids + r.response_ids for r in rollouts]).get()[
        0
    ]
    gaps = [
        (torch.tensor(lps[i][-len(r.response_ids) :]) - new[i, : len(r.response_ids)]).abs()
        for i, r in enumerate(rollouts)
    ]
    assert torch.cat(gaps).mean() <= 0.02
    assert _cpu_modules(actor, engines) == []  # workers, weight sync and engines ran without the CPU package
