"""benchmarks/roofline.py: each phase's rate against the measured roofline (hand-computed figures), the FLOPs each
trl_compare mode is credited with per phase, and the CPU facts every result records."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import roofline  # noqa: E402

PROF = {  # FLOPs per step, as flop_profile.profile gives them
    "orlhf": {"generate": 10e9, "score": 20e9, "train": 60e9},
    "trl": {"generate": 30e9, "score": 80e9, "train": 240e9},
}


def test_phase_rates_divide_flops_by_seconds_and_by_the_roofline():
    out = roofline.phase_rates({"score": 20e9, "train": 60e9, "generate": 1e9}, {"score": 4.0, "train": 6.0}, 50.0)
    # score: 20 GFLOP / 4 s = 5 GFLOP/s = 10% of 50; train: 60 / 6 = 10 GFLOP/s = 20%; generate: not timed, left out
    assert out == {
        "score": {"gflop": 20.0, "s": 4.0, "gflop_s": 5.0, "of_roofline": 0.1},
        "train": {"gflop": 60.0, "s": 6.0, "gflop_s": 10.0, "of_roofline": 0.2},
    }


def test_each_mode_is_credited_with_its_own_layout_and_generator():
    orlhf = roofline.mode_rates(PROF, "orlhf", {"generate": 1.0, "score": 2.0, "train": 3.0}, 100.0)
    assert [orlhf[p]["gflop_s"] for p in ("generate", "score", "train")] == [10.0, 10.0, 20.0]
    # TRL times generation and its reference forward as one phase: its padded generate + its score
    trl = roofline.mode_rates(PROF, "trl", {"generate_score": 11.0, "train": 24.0}, 100.0)
    assert trl == {
        "generate_score": {"gflop": 110.0, "s": 11.0, "gflop_s": 10.0, "of_roofline": 0.1},
        "train": {"gflop": 240.0, "s": 24.0, "gflop_s": 10.0, "of_roofline": 0.1},
    }
    # the actor's ranks generate with HF generate: TRL's generate count, orlhf's forwards
    trainer = roofline.mode_rates(PROF, "orlhf_trainer", {"generate": 3.0, "score": 2.0}, 100.0)
    assert trainer["generate"]["gflop"] == 30.0 and trainer["score"]["gflop"] == 20.0


def test_cpu_facts_name_the_model_and_the_kernel_flags():
    facts = roofline.cpu_facts()
    assert facts["cores"] >= 1 and facts["flags"]  # Linux: lscpu or /proc/cpuinfo
    assert set(facts["kernel_flags"]) <= set(facts["flags"].split())
    assert set(facts["kernel_flags"]) <= set(roofline.KERNEL_FLAGS)


def test_cpu_facts_record_the_instruction_set_limits_a_run_was_given(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert roofline.cpu_facts()["isa_limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
