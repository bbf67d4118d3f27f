"""benchmarks/trl_compare.py end to end at the smallest size: orlhf and TRL's GRPOTrainer, 2 steps each, one final
JSON line. Runs only where TRL's virtualenv is already installed (the script installs it from the package
registry on its first run; a test must not need the network), else it is skipped with the reason."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def _trl_venv() -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trl_compare import TRL_VERSION

    from orlhf.demo.builder import default_cache_dir

    return Path(os.environ.get("ORLHF_TRL_VENV") or default_cache_dir() / f"trl-venv-{TRL_VERSION}")


@pytest.fixture(scope="module")
def compare(tmp_path_factory):
    venv = _trl_venv()
    if not (venv / "bin" / "python").exists():
        pytest.skip(
            f"no TRL virtualenv at {venv}: run benchmarks/trl_compare.py once (it installs TRL from the "
            "package registry), or point ORLHF_TRL_VENV at one; this test never installs"
        )
    out = tmp_path_factory.mktemp("trl_compare")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/trl_compare.py",
            "--no_install",
            "--trl_venv",
            str(venv),
            "--modes",
            "orlhf,trl",
            "--max_samples",
            "128",
            "--episodes",
            "1",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, proc.stdout


def test_both_sides_run_and_the_last_line_is_one_json_object(compare):
    out, stdout = compare
    result = json.loads(stdout.strip().splitlines()[-1])
    for mode in ("orlhf", "trl"):
        r = result["modes"][mode]
        assert "error" not in r, r
        assert r["samples_per_s"] > 0 and r["startup_s"] > 0 and r["steps_measured"] == 1
        assert 0 < r["busy_share"] <= 1.05 and r["cpu_s_per_step"] > 0
        if mode == "orlhf":  # CPU seconds per process group before step 1 (sampled when startup.json appears)
            assert {"driver", "RankActor", "EngineActor"} <= set(r["startup_cpu_s"]), r
            assert all(v > 0 for v in r["startup_cpu_s"].values())
            # CPU seconds per measured step by process group: the groups' sum is the tree's figure
            by_group = r["cpu_s_per_step_by_group"]
            assert {"RankActor", "EngineActor"} <= set(by_group) and by_group["EngineActor"] > 0, r
            assert sum(by_group.values()) == pytest.approx(r["cpu_s_per_step"], abs=0.01 * len(by_group))
        assert math.isfinite(r["reward_first"]) and math.isfinite(r["reward_last"])
    assert result["modes"]["trl"]["ratio_vs_trl"] == 1.0
    assert result["modes"]["orlhf"]["ratio_vs_trl"] > 0
    assert result["modes"]["orlhf"]["ratios_per_repeat"] == [
        pytest.approx(result["modes"]["orlhf"]["ratio_vs_trl"], abs=1e-3)
    ]  # one repeat: the same ratio
    assert {"generate_score", "train"} == set(result["modes"]["trl"]["phases"])
    assert {"generate", "score", "train"} <= set(result["modes"]["orlhf"]["phases"])
    # equal work: 64 prompts x 4 samples per step on both sides
    rows = {m: [json.loads(x) for x in open(out / f"{m}-r0" / "metrics.jsonl")] for m in ("orlhf", "trl")}
    assert [r["samples"] for r in rows["orlhf"]] == [r["samples"] for r in rows["trl"]] == [256, 256]
    startup = json.loads((out / "orlhf-r0" / "startup.json").read_text())
    assert {"ray", "groups init", "engines ready"} <= set(startup["phases_s"])
