"""--vllm_sync_with_ray's decisions that need no cluster: its spellings, its refusals, where it has no effect, and
the engine environment it asks for on GPUs. The sync itself: tests/vllm/test_engines.py."""

import importlib.util
import logging

import pytest

from orlhf.cli import main
from orlhf.config.flags import build_config
from orlhf.config.train_config import ConfigError


def build(**flags):
    return build_config(flags, explicit=set(flags))


def problems(**flags) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build(**flags)
    return err.value.problems


@pytest.mark.parametrize("spelling", ["--vllm_sync_with_ray", "--vllm.sync_with_ray", "--vllm-sync-with-ray"])
def test_every_spelling_reaches_the_config(capsys, no_training, spelling):
    with pytest.raises(SystemExit) as e:
        main(["train-ppo", "--device", "cpu", spelling])
    assert e.value.code == 0, capsys.readouterr().err
    assert no_training[0].vllm.sync_with_ray
    assert not build(device="cpu").vllm.sync_with_ray  # off by default


def test_nccl_through_ray_needs_cupy_and_says_so_in_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))
    found = [p for p in problems(device="cuda", vllm_sync_with_ray=True) if "--vllm_sync_with_ray" in p]
    assert len(found) == 1 and "cupy" in found[0] and "pip install cupy-cuda12x" in found[0], found
    # no Ray NCCL group, no cupy needed: gloo, and CUDA IPC under --colocate_all_models
    assert build(device="cuda", vllm_sync_with_ray=True, vllm_sync_backend="gloo").vllm.sync_with_ray
    assert build(device="cuda", vllm_sync_with_ray=True, colocate_all_models=True).vllm.sync_with_ray
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cupy" else real(name, *a))
    assert build(device="cuda", vllm_sync_with_ray=True).vllm.sync_with_ray


def test_refused_by_name_where_no_engine_runs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-ppo", "--device", "cpu", "--vllm_num_engines", "0", "--vllm_sync_with_ray"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--vllm_sync_with_ray" in err and "--vllm_num_engines 0" in err
    assert "Traceback" not in err


def test_gpu_engines_run_their_core_in_the_engine_actor_only_for_a_ray_group():
    """ray.util.collective joins only from a Ray worker: the vLLM worker must live in the engine actor's process."""
    from orlhf.rollout.engine_config import engine_config, engine_env

    def env(**flags):
        cfg = build(device="cuda", vllm_sync_backend="gloo", **flags)  # gloo: no cupy needed here
        return engine_env(engine_config(cfg), [0], 1.0)

    assert env(vllm_sync_with_ray=True).get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env()
    # CUDA IPC has no group: the engine core keeps its own process
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env(vllm_sync_with_ray=True, colocate_all_models=True)


def test_cuda_ipc_ignores_the_flag_with_a_line(monkeypatch, caplog):
    """As OpenRLHF, whose CUDA IPC path sets up no group either; said, not silent."""
    from orlhf.rollout import weight_sync

    monkeypatch.setattr(weight_sync, "IpcWeightSync", lambda actor, engines, timeout_s: "ipc")
    cfg = build(device="cuda", vllm_sync_with_ray=True, colocate_all_models=True)
    with caplog.at_level(logging.WARNING, logger="orlhf"):
        assert weight_sync.make_weight_sync(cfg, None, None) == "ipc"
    assert "--vllm_sync_with_ray: no broadcast group" in caplog.text and "CUDA IPC" in caplog.text
