"""OpenRLHF's DeepSpeed and data knobs that orlhf once accepted only at their off value, each where it acts:
--gradient_checkpointing_use_reentrant, --overlap_comm, --grad_accum_dtype, --zpg, --full_determinism,
--use_liger_kernel (flags -> WorkerConfig -> ds_config / the worker's set-up / the model class), --max_ckpt_mem
(tests/unit/test_checkpoint.py), --dataloader_num_workers and --disable_fast_tokenizer (documented no-ops).
tests/workers/test_knobs_mp.py runs them in real workers."""

import os
import sys
import types

import pytest
import torch

from orlhf.config.fingerprint import FREE_ON_RESUME, config_fingerprint
from orlhf.config.flags import parse_config
from orlhf.config.openrlhf import NO_EFFECT, UNSUPPORTED
from orlhf.config.train_config import ConfigError
from orlhf.config.validation import validate
from orlhf.config.worker_config import role_config, worker_config
from orlhf.workers.deepspeed_setup import DETERMINISM_ENV, ds_config, enable_gradient_checkpointing, seed_everything

KNOBS = (
    "gradient_checkpointing_use_reentrant",
    "overlap_comm",
    "grad_accum_dtype",
    "zpg",
    "full_determinism",
    "use_liger_kernel",
    "max_ckpt_mem",
    "dataloader_num_workers",
)


def _cfg(device: str = "cpu", **flags):
    from orlhf.config.resolve import resolve_device

    flags = {"pretrain": "model", "reward_pretrain": "rm", "use_kl_loss": True, **flags}
    return resolve_device(parse_config(flags, set(flags)), device)


def _problems(device: str = "cpu", explicit=(), **flags) -> str:
    """validate()'s problems with the demo's run (no files to make) and `flags`, on `device`: "" when none."""
    from orlhf.config.resolve import resolve_device

    try:
        validate(resolve_device(parse_config(flags, set(flags)), device), explicit)
    except ConfigError as e:
        return str(e)
    return ""


def _run(argv, capsys):
    from orlhf.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


# ---- the flag table and the command line ----------------------------------------------------------------------


def test_none_of_the_knobs_is_refused_any_more():
    for flag in (*KNOBS, "disable_fast_tokenizer"):
        assert flag not in UNSUPPORTED, flag
    assert "disable_fast_tokenizer" in NO_EFFECT  # see test_disable_fast_tokenizer_loads_the_same_tokenizer


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--gradient_checkpointing",
            "--gradient_checkpointing_use_reentrant",
            "--overlap_comm",
            "--grad_accum_dtype",
            "fp32",
            "--zpg",
            "2",
            "--full_determinism",
            "--max_ckpt_mem",
            "1.5",
            "--dataloader_num_workers",
            "4",
            "--disable_fast_tokenizer",
        ],
        [  # OpenRLHF 0.11's dotted names
            "--actor.gradient_checkpointing_enable",
            "--actor.gradient_checkpointing_reentrant",
            "--ds.overlap_comm",
            "--ds.grad_accum_dtype",
            "fp32",
            "--ds.zpg",
            "2",
            "--train.full_determinism_enable",
            "--ckpt.max_mem",
            "1.5",
            "--data.dataloader_num_workers",
            "4",
            "--data.disable_fast_tokenizer",
        ],
    ],
    ids=["flat", "dotted"],
)
def test_the_knobs_reach_the_config(capsys, no_training, argv):
    code, err = _run(["train-ppo", "--device", "cpu", "--actor_num_gpus_per_node", "2", *argv], capsys)
    assert code == 0, err
    ds, cfg = no_training[0].deepspeed, no_training[0]
    assert ds.gradient_checkpointing_use_reentrant and ds.overlap_comm and ds.full_determinism
    assert (ds.grad_accum_dtype, ds.zpg) == ("fp32", 2)
    assert cfg.logging.max_ckpt_mem == 1.5 and cfg.data.dataloader_num_workers == 4


def test_each_role_gets_the_knobs_and_liger_reaches_the_causal_lms_only():
    cfg = _cfg(
        "cuda",
        gradient_checkpointing=True,
        gradient_checkpointing_use_reentrant=True,
        overlap_comm=True,
        grad_accum_dtype="fp32",
        zpg=4,
        full_determinism=True,
        use_liger_kernel=True,
    )
    for role in ("actor", "ref", "critic", "reward"):
        w = worker_config(cfg, role)
        assert w.gradient_checkpointing_use_reentrant and w.full_determinism and w.overlap_comm, role
        assert (w.grad_accum_dtype, w.zpg) == ("fp32", 4), role
        assert w.use_liger_kernel == (role in ("actor", "ref")), role  # OpenRLHF's Actor only, not its value models


def test_the_fingerprint_holds_the_knobs_that_change_numbers_only():
    fp = config_fingerprint(_cfg())
    for flag in ("grad_accum_dtype", "zpg", "full_determinism", "use_liger_kernel"):
        assert f"--{flag}" in fp and flag not in FREE_ON_RESUME
    for flag in ("gradient_checkpointing_use_reentrant", "overlap_comm", "max_ckpt_mem", "dataloader_num_workers"):
        assert f"--{flag}" not in fp and len(FREE_ON_RESUME[flag]) > 10


# ---- validation -----------------------------------------------------------------------------------------------


def test_ranges_and_knobs_that_would_do_nothing_are_refused_by_name():
    assert not _problems(dataloader_num_workers=0) and not _problems(dataloader_num_workers=16)
    assert "--dataloader_num_workers must be >= 0 (got -1)" in _problems(dataloader_num_workers=-1)
    assert not _problems(max_ckpt_mem=0.0) and not _problems(max_ckpt_mem=float("inf"))
    assert "--max_ckpt_mem must be >= 0 GiB" in _problems(max_ckpt_mem=-1.0)
    assert "--max_ckpt_mem must be >= 0 GiB" in _problems(max_ckpt_mem=float("nan"))
    alone = _problems(explicit={"gradient_checkpointing_use_reentrant"}, gradient_checkpointing_use_reentrant=True)
    assert "--gradient_checkpointing_use_reentrant does nothing without --gradient_checkpointing" in alone
    assert not _problems(gradient_checkpointing=True, gradient_checkpointing_use_reentrant=True)


def test_zpg_needs_a_trained_zero3_group_it_divides():
    assert "--zpg must be >= 1 (got 0)" in _problems(zpg=0)
    assert "--zpg 2 does nothing here" in _problems(zpg=2)  # one-rank groups: no ZeRO, nothing to partition
    assert "--zpg 2 does nothing here" in _problems(zpg=2, actor_num_gpus_per_node=2, zero_stage=2)
    assert not _problems(zpg=2, actor_num_gpus_per_node=4)  # ZeRO-3 by default over 4 ranks
    assert not _problems(zpg=8, actor_num_gpus_per_node=4)  # larger than the group: all of it, as DeepSpeed
    bad = _problems(zpg=4, actor_num_gpus_per_node=6)
    assert "--zpg 4 must divide the actor's 6 ranks" in bad


def test_grad_accum_dtype_other_than_the_models_needs_zero():
    assert not _problems(grad_accum_dtype="fp32", bf16=True)  # one-rank groups keep ZeRO-2 for it
    assert not _problems(grad_accum_dtype="fp32", zero_stage=0)  # the model's own dtype
    msg = _problems(grad_accum_dtype="fp32", bf16=True, zero_stage=0)
    assert "--grad_accum_dtype fp32: the actor trains without ZeRO (stage 0)" in msg and "(bf16)" in msg


def test_grad_accum_dtype_takes_deepspeeds_names_only(capsys):
    code, err = _run(["train-ppo", "--device", "cpu", "--grad_accum_dtype", "float64"], capsys)
    assert code == 2 and "--grad_accum_dtype" in err


def test_liger_is_refused_on_cpu_in_one_line_and_needs_its_package_on_gpus(capsys, monkeypatch):
    code, err = _run(["train-ppo", "--device", "cpu", "--use_liger_kernel"], capsys)
    lines = [line for line in err.splitlines() if "--use_liger_kernel" in line]
    assert code == 2 and len(lines) == 1 and "needs CUDA GPUs" in lines[0], err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name))
    msg = _problems("cuda", use_liger_kernel=True)
    assert "liger_kernel package is not importable" in msg and "pip install liger-kernel" in msg
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name)
    )
    assert not _problems("cuda", use_liger_kernel=True)


# ---- ds_config: the DeepSpeed dict of each role ---------------------------------------------------------------

TRAIN = dict(learning_rate=1e-3, train_batch_size=8, micro_train_batch_size=2)


def test_trained_models_get_overlap_comm_grad_accum_dtype_and_zpg_as_openrlhfs_train_config():
    actor = role_config("actor", model_path="m", device="cuda", zero_stage=3, **TRAIN)
    plain = ds_config(actor, 4)
    assert "data_types" not in plain and "overlap_comm" not in plain["zero_optimization"]
    assert "zero_hpz_partition_size" not in plain["zero_optimization"]
    knobs = dict(overlap_comm=True, grad_accum_dtype="fp32", zpg=2)
    c = ds_config(role_config("actor", model_path="m", device="cuda", zero_stage=3, **TRAIN, **knobs), 4)
    zero = c["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert zero["zero_hpz_partition_size"] == 2 and c["data_types"] == {"grad_accum_dtype": "fp32"}
    critic = ds_config(role_config("critic", model_path="m", device="cpu", zero_stage=2, **TRAIN, **knobs), 2)
    assert critic["zero_optimization"]["overlap_comm"] and critic["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "zero_hpz_partition_size" not in critic["zero_optimization"]  # ZeRO-3's only


def test_one_rank_zero_2_keeps_no_contiguous_gradient_buffer():
    """One rank reduces nothing: DeepSpeed's contiguous bucket would only copy every gradient in and back out."""

    def zero(world, stage=2, **kw):
        return ds_config(role_config("actor", model_path="m", device="cpu", zero_stage=stage, **TRAIN, **kw), world)

    assert zero(1)["zero_optimization"]["contiguous_gradients"] is False
    assert zero(1, stage=1)["zero_optimization"]["contiguous_gradients"] is False
    assert "contiguous_gradients" not in zero(2)["zero_optimization"]  # DeepSpeed's default where ranks reduce
    assert "contiguous_gradients" not in zero(1, stage=3)["zero_optimization"]
    assert zero(1, overlap_comm=True)["zero_optimization"]["contiguous_gradients"] is True  # asked for


def test_zpg_is_clamped_to_the_world_and_left_out_where_that_is_one_rank():
    def hpz(world, zpg):
        cfg = role_config("actor", model_path="m", device="cuda", zero_stage=3, zpg=zpg, **TRAIN)
        return ds_config(cfg, world)["zero_optimization"].get("zero_hpz_partition_size")

    assert (hpz(4, 2), hpz(4, 8), hpz(1, 8), hpz(4, 1)) == (2, 4, None, None)


def test_frozen_models_get_none_of_the_training_knobs():
    knobs = dict(overlap_comm=True, grad_accum_dtype="fp32", zpg=2)
    for role in ("ref", "reward"):
        c = ds_config(role_config(role, model_path="m", device="cuda", zero_stage=3, **knobs), 4)
        assert c["zero_optimization"] == {"stage": 3} and "data_types" not in c, role


DS_STEP = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")
import torch
from orlhf.config.worker_config import role_config
from orlhf.workers.deepspeed_setup import ds_config, init_distributed
init_distributed("cpu")
import deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(torch.bfloat16)
cfg = role_config("actor", model_path="m", device="cpu", zero_stage=2, bf16=True, learning_rate=1e-2,
                  train_batch_size=4, micro_train_batch_size=2, overlap_comm=True, grad_accum_dtype="fp32")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg, 1), dist_init_required=False)
x = torch.randn(4, 8, dtype=torch.bfloat16)
for i in range(2):  # one optimizer step of two micro-batches
    engine.backward(engine(x[2 * i : 2 * i + 2]).float().pow(2).mean())
    engine.step()
print(json.dumps({"overlap": engine.zero_overlap_comm(), "contiguous": engine.zero_contiguous_gradients(),
                  "accum": str(engine.get_data_types()[1]),
                  "opt_accum": str(engine.optimizer.gradient_accumulation_dtype), "steps": engine.global_steps}))
"""


def test_deepspeed_runs_a_zero2_step_with_overlap_comm_and_an_fp32_accumulator():
    """Real DeepSpeed on one CPU rank, in a fresh interpreter: the engine reads both knobs from ds_config's dict."""
    import json
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-c", DS_STEP, str(port)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "overlap": True,
        "contiguous": True,
        "accum": "torch.float32",
        "opt_accum": "torch.float32",
        "steps": 1,
    }


# ---- the worker's set-up: gradient checkpointing and determinism ----------------------------------------------


@pytest.fixture
def tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    return lambda: LlamaForCausalLM(cfg)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_runs_torchs_reentrant_checkpoint_only_when_asked(tiny_lm, monkeypatch, reentrant):
    import torch.utils.checkpoint as ckpt

    calls = []
    apply = ckpt.CheckpointFunction.apply  # the reentrant implementation's entry point
    monkeypatch.setattr(ckpt.CheckpointFunction, "apply", staticmethod(lambda *a: calls.append(1) or apply(*a)))
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def grads(model):
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    torch.manual_seed(0)
    reference = grads(tiny_lm())
    torch.manual_seed(0)
    model = tiny_lm()
    flags = dict(gradient_checkpointing=True, gradient_checkpointing_use_reentrant=reentrant)
    cfg = role_config("actor", model_path="m", device="cpu", **TRAIN, **flags)
    enable_gradient_checkpointing(model, cfg)
    assert model.model.layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": reentrant}
    checkpointed = grads(model)
    assert len(calls) == (2 if reentrant else 0)  # one per decoder layer
    assert all(torch.allclose(checkpointed[n], reference[n], atol=1e-6) for n in reference)  # the same gradients


@pytest.fixture
def restore_determinism():
    """The process as it was after the test: seed_everything(full_determinism=True) writes os.environ itself, and
    processes this one spawns later (the multi-process worker tests) would inherit what it left."""
    saved = {name: os.environ.pop(name, None) for name in DETERMINISM_ENV}
    state = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    bench = torch.backends.cudnn.benchmark
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.use_deterministic_algorithms(state[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = state[1], bench


def test_full_determinism_sets_deterministic_kernels_and_seeds(restore_determinism):
    seed_everything(7)  # without the flag: seeds only
    assert not torch.are_deterministic_algorithms_enabled()
    assert not any(name in os.environ for name in DETERMINISM_ENV)
    plain = torch.rand(3)
    seed_everything(7, full_determinism=True)
    assert torch.equal(torch.rand(3), plain)  # seeded the same
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"


# ---- Liger's model class ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in liger_kernel package (not installed here) whose AutoLigerKernelForCausalLM records its loads."""
    loads = []

    class AutoLigerKernelForCausalLM:
        @classmethod
        def from_pretrained(cls, path, **kw):
            loads.append((path, kw))
            return "liger model"

    pkg, sub = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    sub.AutoLigerKernelForCausalLM = AutoLigerKernelForCausalLM
    pkg.transformers = sub
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", sub)
    return AutoLigerKernelForCausalLM, loads


def test_liger_loads_the_actor_and_reference_through_autoligerkernelforcausallm(fake_liger):
    from transformers import AutoModel, AutoModelForCausalLM

    from orlhf.workers.loading import from_pretrained, model_class

    liger_cls, loads = fake_liger
    actor = role_config("actor", model_path="m", device="cuda", use_liger_kernel=True, bf16=True, **TRAIN)
    assert model_class(AutoModelForCausalLM, actor) is liger_cls
    assert model_class(AutoModel, actor) is AutoModel  # a value model's backbone: as OpenRLHF, no Liger
    off = role_config("ref", model_path="m", device="cuda")
    assert model_class(AutoModelForCausalLM, off) is AutoModelForCausalLM
    assert from_pretrained(AutoModelForCausalLM, "/models/p", actor) == "liger model"
    assert loads == [("/models/p", {"dtype": torch.bfloat16, "attn_implementation": "sdpa"})]


def test_liger_without_its_package_or_on_cpu_is_a_clear_error(monkeypatch):
    from transformers import AutoModelForCausalLM

    from orlhf.workers.loading import model_class

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails, as where it is not installed
    cuda = role_config("ref", model_path="m", device="cuda", use_liger_kernel=True)
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        model_class(AutoModelForCausalLM, cuda)
    with pytest.raises(ValueError, match="--use_liger_kernel needs CUDA GPUs"):
        model_class(AutoModelForCausalLM, role_config("ref", model_path="m", device="cpu", use_liger_kernel=True))


# ---- the no-ops ------------------------------------------------------------------------------------------------


def test_disable_fast_tokenizer_loads_the_same_tokenizer():
    """The ground for NO_EFFECT["disable_fast_tokenizer"]: OpenRLHF v0.10.1 passes use_fast=False to AutoTokenizer,
    which transformers 5 ignores. If a transformers release honours it again, this fails: wire the flag then."""
    from transformers import AutoTokenizer

    from orlhf.demo.builder import ensure_demo

    path = str(ensure_demo().model)
    fast, slow = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path, use_fast=False)
    assert type(slow) is type(fast) and slow.is_fast
    texts = ["Hello world", "  spaces\tand\nnewlines ", "ünïcödé 123 <s> </s>"]
    assert [slow.encode(t) for t in texts] == [fast.encode(t) for t in texts]
