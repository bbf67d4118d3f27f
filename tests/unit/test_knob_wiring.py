"""The run hands --max_ckpt_mem to its CheckpointManager, and --full_determinism to the vLLM engines (in-process
engine core on GPUs, as OpenRLHF)."""

import dataclasses

from orlhf.config.flags import parse_config
from orlhf.rollout.engine_config import EngineConfig, engine_config, engine_env


def test_full_determinism_runs_gpu_engines_in_process():
    plain = EngineConfig(model_path="m", device="cuda")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in engine_env(plain, [0], 1.0)
    det = dataclasses.replace(plain, full_determinism=True)
    assert engine_env(det, [0], 1.0)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    from orlhf.config.resolve import resolve_device

    cfg = resolve_device(
        parse_config({"pretrain": "m", "full_determinism": True}, {"pretrain", "full_determinism"}), "cuda"
    )
    assert engine_config(cfg).full_determinism


def test_the_run_gives_its_checkpoint_manager_the_disk_budget(monkeypatch, tmp_path):
    import orlhf.launch.run_inputs as run_inputs
    import orlhf.storage.checkpoint as checkpoint

    made = []

    class Stop(Exception):
        pass

    def manager(*a, **kw):
        made.append(kw.get("max_ckpt_mem"))
        raise Stop

    monkeypatch.setattr(checkpoint, "CheckpointManager", manager)
    cfg = parse_config({"max_ckpt_mem": 2.5, "save_path": str(tmp_path)}, {"max_ckpt_mem", "save_path"})
    monkeypatch.setattr(run_inputs, "check_lora_targets", lambda cfg: None)

    class Logs:
        def route_transformers(self):
            pass

    try:
        run_inputs.read_files(cfg, "run-id", Logs())
    except Stop:
        pass
    assert made == [2.5]
