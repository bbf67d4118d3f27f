"""--bf16 on a CPU without bf16 instructions (orlhf/cpu/bf16.py, reached through the tuning seam's preflight hook):
refused before Ray starts with the CPU, the missing flags and the slowdown timed on the spot; --allow_slow_bf16 turns
it into a warning; a CPU with the instructions, an fp32 run and --device cuda are never concerned. The CPU's flags and
the timing are faked here (any machine runs these tests); one test times the real matmuls."""

import logging

import pytest

import orlhf.cpu.bf16 as bf16
from orlhf.cli import run_reporting_errors
from orlhf.config.flags import build_config
from orlhf.config.resolve import finish_config
from orlhf.config.train_config import ConfigError
from orlhf.cpu.bf16 import CpuInfo, check_bf16, cpu_info, matmul_seconds
from orlhf.launch.bringup import tuning_for
from orlhf.launch.preflight import preflight

AVX2_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2

processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2
"""
SAPPHIRE_RAPIDS = (
    "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
)
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"
# emulated bf16: 25x the fp32 time, as a 64x576 @ 576x576 product on an AVX2-only EPYC (a faked timing)
TIMING = {"fp32": 0.00098, "bf16": 0.0245}


def cfg(**flags):
    flags = {"device": "cpu", **flags}
    return build_config(flags, set(flags))


def read(tmp_path, text):
    (tmp_path / "cpuinfo").write_text(text)
    return cpu_info(str(tmp_path / "cpuinfo"))


def test_cpuinfo_gives_the_model_and_whether_bf16_is_native(tmp_path):
    epyc = read(tmp_path, AVX2_EPYC)
    assert (epyc.model, epyc.arch, epyc.native_bf16) == ("AMD EPYC", "x86", False)
    assert "avx2" in epyc.flags and epyc.missing() == "neither avx512_bf16 nor amx_bf16"
    assert read(tmp_path, SAPPHIRE_RAPIDS).native_bf16
    arm = read(tmp_path, GRAVITON3)
    assert (arm.arch, arm.native_bf16) == ("arm", True)
    assert CpuInfo("arm", "arm", frozenset({"asimd"})).missing() == "no bf16"
    assert cpu_info(str(tmp_path / "absent")) is None and read(tmp_path, "processor\t: 0\n") is None


def test_bf16_on_a_cpu_without_the_instructions_is_refused_naming_the_ways_out(tmp_path):
    with pytest.raises(ConfigError) as refused:
        check_bf16(cfg(bf16=True), read(tmp_path, AVX2_EPYC), timing=lambda: TIMING)
    assert refused.value.problems == [
        "--bf16 on --device cpu: this CPU (AMD EPYC) has neither avx512_bf16 nor amx_bf16 among its flags, so torch "
        "emulates bf16, and a bf16 matmul ran 25x slower than fp32 here (measured now: 64x576 @ 576x576 in 24.5 ms "
        "against 0.98 ms). Drop --bf16 to train in fp32, or pass --allow_slow_bf16 to train in bf16 anyway."
    ]


def test_allow_slow_bf16_is_a_warning_without_timing(tmp_path, caplog):
    def timing():
        raise AssertionError("not timed when the user insists")

    with caplog.at_level(logging.WARNING, logger="orlhf"):
        check_bf16(cfg(bf16=True, allow_slow_bf16=True), read(tmp_path, AVX2_EPYC), timing=timing)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("--allow_slow_bf16: this CPU (AMD EPYC) has neither avx512_bf16 nor amx_bf16 among")


@pytest.mark.parametrize(
    "flags,cpuinfo",
    [
        ({"bf16": True}, SAPPHIRE_RAPIDS),  # native bf16
        ({"bf16": True}, GRAVITON3),
        ({}, AVX2_EPYC),  # fp32
        ({"bf16": True, "device": "cuda"}, AVX2_EPYC),  # the GPU computes
    ],
)
def test_native_cpus_fp32_and_gpu_runs_are_never_concerned(tmp_path, flags, cpuinfo):
    def timing():
        raise AssertionError("nothing to time")

    check_bf16(cfg(**flags), read(tmp_path, cpuinfo), timing=timing)


def test_the_refusal_comes_from_the_preflight_before_ray_through_the_seam_and_exits_2(tmp_path, monkeypatch, capsys):
    epyc = read(tmp_path, AVX2_EPYC)
    monkeypatch.setattr(bf16, "cpu_info", lambda: epyc)
    monkeypatch.setattr(bf16, "matmul_seconds", lambda: TIMING)
    tuning_for(cfg(bf16=True, device="cuda")).preflight(cfg(bf16=True, device="cuda"))  # the plain path: nothing
    flags = {"device": "cpu", "bf16": True, "save_path": str(tmp_path / "run")}
    run = finish_config(flags, set(flags))  # the demo's, as launch/run.py gets it
    assert run_reporting_errors(preflight, run) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "error: 1 problem(s) with the flags:" and len(err) == 2
    assert err[1].startswith("  - --bf16 on --device cpu: this CPU (AMD EPYC) has neither avx512_bf16 nor amx_bf16")


def test_allow_slow_bf16_without_bf16_does_nothing_and_is_refused():
    with pytest.raises(ConfigError, match="--allow_slow_bf16 does nothing without --bf16"):
        cfg(allow_slow_bf16=True)
    cfg(allow_slow_bf16=True, bf16=True)


def test_the_timing_on_the_spot_is_short():
    s = matmul_seconds(repeats=1)
    assert set(s) == {"fp32", "bf16"} and all(0 < t < 1 for t in s.values())
