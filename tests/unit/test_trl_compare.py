"""benchmarks/trl_compare.py's pure figures: ratios against TRL (the median run's, and paired per repeat) and the
CPU seconds per step by process group; and the hybrid mode's command (the sync orlhf mode's flags, the baseline's
program). The end-to-end run is tests/e2e/test_trl_compare_smoke.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trl_compare  # noqa: E402


def test_ratios_are_the_medians_ratio_and_the_median_of_each_repeats_own_ratio():
    runs = {
        "trl": [{"samples_per_s": 100.0}, {"samples_per_s": 200.0}, {"samples_per_s": 100.0}],
        "orlhf": [{"samples_per_s": 150.0}, {"samples_per_s": 220.0}, {"samples_per_s": 120.0}],
        "broken": [{"error": "no rows"}, {"samples_per_s": 300.0}, {"error": "no rows"}],
    }
    result = {m: trl_compare.median_of(rs) for m, rs in runs.items()}
    trl_compare.add_ratios(result, runs)
    assert result["orlhf"]["ratio_vs_trl"] == pytest.approx(150.0 / 100.0)  # median over median
    assert result["orlhf"]["ratios_per_repeat"] == [1.5, 1.1, 1.2]  # each run over its repeat's TRL run
    assert result["orlhf"]["ratio_vs_trl_paired"] == pytest.approx(1.2)
    assert result["trl"]["ratio_vs_trl_paired"] == 1.0
    assert result["broken"]["ratios_per_repeat"] == [1.5]  # repeats whose run failed are left out, not shifted


def test_no_trl_mode_means_no_ratios():
    runs = {"orlhf": [{"samples_per_s": 150.0}]}
    result = {m: trl_compare.median_of(rs) for m, rs in runs.items()}
    trl_compare.add_ratios(result, runs)
    assert "ratio_vs_trl" not in result["orlhf"] and "ratios_per_repeat" not in result["orlhf"]


def test_cpu_per_step_by_group_counts_the_measured_steps_only():
    # CPU seconds used so far by each group when rows 1..4 landed; warm-up 1: steps 2-4 are measured
    cpu_at_rows = [
        {"driver": 1.0, "EngineActor": 5.0},
        {"driver": 1.1, "EngineActor": 5.6},
        {"driver": 1.2, "EngineActor": 6.2},
        {"driver": 1.3, "EngineActor": 6.8, "RankActor": 0.3},
    ]
    by_group = trl_compare.per_group_cpu(cpu_at_rows, warmup=1, n=4)
    assert by_group == {
        "EngineActor": pytest.approx(0.6),
        "RankActor": pytest.approx(0.1),
        "driver": pytest.approx(0.1),
    }


def test_rank_processes_group_together_whatever_their_actor_class():
    """CPU runs' rank processes are CpuRankActors: their memory and CPU count under the ranks' group."""
    from proctree import rss_group

    assert rss_group(7, ["ray::CpuRankActor.call_as"], 1) == "RankActor"
    assert rss_group(7, ["ray::RankActor"], 1) == "RankActor"
    assert rss_group(7, ["ray::EngineActor.generate"], 1) == "EngineActor"
    assert rss_group(7, ["ray::IDLE"], 1) == "ray system"


def test_hybrid_mode_is_the_sync_orlhf_command_with_the_baselines_program():
    from trl_compare_hybrid import BASELINE, hybrid_cmd

    a = trl_compare.parse_args(["--modes", "orlhf,hybrid", "--orlhf_flags", "--zero_stage 3"])
    orlhf = trl_compare.orlhf_cmd(a, False)
    # the same python and every flag (the work, --orlhf_flags included); only the program differs
    assert hybrid_cmd(orlhf) == [sys.executable, str(BASELINE), *orlhf[4:]]
    assert orlhf[-2:] == ["--zero_stage", "3"]
    with pytest.raises(ValueError, match="not an orlhf train-ppo command"):
        hybrid_cmd([sys.executable, "other.py", "--zero_stage", "3"])
