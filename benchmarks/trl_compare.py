"""orlhf against TRL's GRPOTrainer at equal work on the demo, interleaved, in one invocation; on CPU or one GPU.

    TRL: installed by this script into its own virtualenv (<cache>/trl-venv-<version>; orlhf's stays clean):
         python -m venv, pip install torch==<orlhf's torch> (same build: CPU wheel on CPU), then trl==<version>
         with torch pinned by a constraints file. Reused when it already imports that TRL version.
    equal work: the demo model, the first --max_samples demo prompts, the demo reward function; per step
         64 prompts x 4 samples = 256 completions and ONE optimizer step (micro-batch 64), 24 new tokens,
         temperature 1, lr 5e-4 cosine to 10%, fp32, group-normalised advantages, PPO clip 0.2, KL 0.01 as a k3 loss
         term against the reference (TRL's beta; orlhf --use_kl_loss --kl_estimator k3); --kl 0: no reference on
         either side (TRL beta 0; orlhf --init_kl_coef 0).
    for repeat: for mode in --modes:      interleaved, so machine-load drift hits every side alike
        orlhf        orlhf train-ppo (sync)          orlhf_async   the same with --async_train
        orlhf_1thread  sync with one thread per process (--vllm_cpu_threads 1 --train_cpu_threads 1): no per-phase
                     hand-over of the cores (orlhf/cpu/threads.py)
        orlhf_engines2 sync with --vllm_num_engines 2: generation data-parallel over the cores, one thread each
        orlhf_trainer  sync with --vllm_num_engines 0: the actor's ranks generate with HF generate, as TRL does
        trl          benchmarks/trl_grpo_runner.py under TRL's python (HF generate; no vLLM on CPU)
        hybrid       benchmarks/hybrid_engine_baseline.py given the sync mode's train-ppo flags (trl_compare_hybrid.py):
                     DeepSpeed-Chat's system at the same work (every model in one process, the trained actor
                     generates with HF generate, phases strictly one after the other, no weight sync); its metrics
                     rows and phases are orlhf's controller's, so it is timed as the orlhf modes are
      each a subprocess; proctree.TreeSampler notes when each metrics.jsonl row lands and the CPU seconds of the
      whole process tree (Ray and vLLM processes included) at that moment
    -> per run: samples/s of the median measured step (steps after --warmup), start-up (launch -> start of step 1
       = arrival of row 1 - its step_s), busy share (CPU seconds / (wall x cores) from the end of the warm-up to
       the last row), CPU seconds per step, seconds per phase (median step), steal share (CPU time the hypervisor
       gave other guests, over the run's wall x cores: a noisy run shows here); per mode the median over repeats
    -> a table, and one final JSON line: every mode's figures and ratio_vs_trl (samples/s over TRL's), with the
       per-repeat ratios (each run over the TRL run of its repeat) and their median, ratio_vs_trl_paired

    --device cuda: both sides on the one GPU in bf16 (orlhf --bf16: bf16 weights, fp32 master weights in DeepSpeed;
         TRL bf16=True: fp32 weights under bf16 autocast), the 0.4b model by default (a random Llama, hidden 1536
         x 16 layers, built on the GPU: bench_train_mfu.py's 0.4b), modes orlhf_trainer and trl by default (no vLLM
         needed), TRL from --trl_python (default: this python; the GPU machine has no package index, so
         scripts/gpu_check.sh installs the carried trl, datasets, dill and multiprocess wheels beside orlhf's)
    --bf16: the --device cuda precisions on CPU (orlhf --bf16, TRL bf16=True), for CPUs with bf16 instructions
         (AVX512_BF16, AMX), where bf16 matrix products run at more than twice fp32's rate
    --profile: after the timed repeats, one more run of each mode with every phase call under the torch profiler
         (trl_grpo_runner.PhaseProfile; orlhf's rank processes load the wrappers through a sitecustomize.py on
         their PYTHONPATH): per mode, GPU seconds (the CUDA kernels' summed time; null on CPU) and wall seconds
         per step of each phase (TRL: generate_score, train; orlhf: generate, score, train, and generate_score =
         generate + score). The profiled run's speed is not counted.

Reproduce (2-core CPU box; about 1.5 min a run at the default 12 steps, so ~14 min with 3 repeats of 3 modes):
    .venv/bin/python benchmarks/trl_compare.py --repeats 3
    .venv/bin/python benchmarks/trl_compare.py --kl 0 --repeats 3               # the no-KL row
The real model (SmolLM2-135M-Instruct, its addition task, chat template; compute dominates, minutes a run):
    .venv/bin/python benchmarks/trl_compare.py --model_preset smollm2 --modes orlhf,trl,hybrid --repeats 2 \
        --prompts_per_step 16 --micro_batch 16 --max_samples 96 --episodes 1 --lr 1e-6 --timeout 3600
On one GPU (scripts/gpu_check.sh runs a short one after tests/gpu):
    python benchmarks/trl_compare.py --device cuda --repeats 2 --profile
Speed figures from a machine shared with other jobs are only comparable within one invocation (see load_avg).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import roofline  # noqa: E402  (benchmarks/roofline.py)
from model_presets import PRESETS, preset_model  # noqa: E402  (benchmarks/model_presets.py)
from proctree import TreeSampler, run_sampled  # noqa: E402  (benchmarks/proctree.py)
from trl_compare_hybrid import hybrid_cmd  # noqa: E402  (benchmarks/trl_compare_hybrid.py)
from trl_grpo_runner import PROFILE_ENV, add_work_args, phase_profile, rank_profiler_hook  # noqa: E402

MODES = ("orlhf", "orlhf_async", "trl", "orlhf_1thread", "orlhf_engines2", "orlhf_trainer", "hybrid")
GPU_MODES = ("orlhf_trainer", "trl")  # --device cuda's default: the modes that need no vLLM
TRL_VERSION = "1.16.0"
SIZES = {"0.4b": (1536, 16)}  # hidden, layers: random Llamas beyond model_presets.PRESETS (bench_train_mfu.py's)


# ---- TRL's own virtualenv ------------------------------------------------------------------------------------


def trl_python(venv: Path, version: str, install: bool) -> Path:
    """The python of a virtualenv holding trl==version, created and installed here when missing (and allowed)."""
    py = venv / "bin" / "python"
    check = f"import sys, trl; sys.exit(trl.__version__ != {version!r})"
    if py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0:
        return py
    if not install:
        raise SystemExit(
            f"no TRL {version} virtualenv at {venv} and --no_install was given: run this script once "
            "without --no_install (it needs the package registry)"
        )
    torch_version = importlib.metadata.version("torch")  # distribution version: "2.13.0+cpu" on the CPU wheel
    print(f"installing TRL {version} into {venv} (torch=={torch_version}); once, a few minutes", flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    (venv / "constraints.txt").write_text(f"torch=={torch_version}\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True)
    subprocess.run([*pip, "-c", str(venv / "constraints.txt"), f"trl=={version}"], check=True)
    if subprocess.run([str(py), "-c", check]).returncode != 0:
        raise SystemExit(f"{venv}: trl=={version} did not install")
    return py


# ---- the two sides' command lines (the same work) ------------------------------------------------------------


def orlhf_cmd(a, asynchronous: bool, extra: tuple = ()) -> list[str]:
    kl = ["--use_kl_loss", "--init_kl_coef", str(a.kl), "--kl_estimator", "k3"] if a.kl > 0 else ["--init_kl_coef", "0"]
    samples = a.prompts_per_step * a.samples_per_prompt
    return [
        sys.executable,
        "-m",
        "orlhf.cli",
        "train-ppo",
        "--device",
        a.device,
        *(["--bf16"] if a.bf16 else []),
        "--max_samples",
        str(a.max_samples),
        "--num_episodes",
        str(a.episodes),
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        str(a.samples_per_prompt),
        "--rollout_batch_size",
        str(a.prompts_per_step),
        "--train_batch_size",
        str(samples),
        "--micro_train_batch_size",
        str(a.micro_batch),
        "--micro_rollout_batch_size",
        str(a.micro_batch),
        "--generate_max_len",
        str(a.new_tokens),
        "--temperature",
        "1.0",
        "--actor_learning_rate",
        str(a.lr),
        "--lr_warmup_ratio",
        "0",
        "--eps_clip",
        "0.2",
        "--seed",
        "42",
        *kl,
        *(["--async_train"] if asynchronous else []),
        *extra,
        *a.orlhf_flags.split(),
    ]


REAL = "smollm2"  # --model_preset: the real model and its addition task (orlhf make-demo --real)


def real_demo(a):
    """The real-model demo's files (demo/arith.py), written once under --out: model, train prompts, reward."""
    from orlhf.demo.arith import RealDemoPaths, make_real_demo

    paths = RealDemoPaths.under((a.out / "real-demo").resolve())
    return paths if paths.reward_fn.is_file() else make_real_demo(paths.root)


def with_real_model(cmd: list[str], a) -> list[str]:
    """An orlhf command on the real model's addition task, as `orlhf make-demo --real` prints it (chat template,
    question/answer keys); the engines in eager mode unless the command has none."""
    demo = real_demo(a)
    no_engine = "--vllm_num_engines" in cmd and cmd[cmd.index("--vllm_num_engines") + 1] == "0"
    data = ["--pretrain", str(demo.model), "--prompt_data", str(demo.train), "--remote_rm_url", str(demo.reward_fn)]
    data += ["--input_key", "question", "--label_key", "answer", "--apply_chat_template", "--prompt_max_len", "128"]
    return [*cmd, *data, *([] if no_engine else ["--enforce_eager"])]


def with_model(cmd: list[str], a) -> list[str]:
    """An orlhf command on --model_preset's folder. For the demo nothing is added: train-ppo without --pretrain
    runs the demo's model, prompts, reward and preset values. With --pretrain it applies none of them, so the
    demo's prompts and reward and every preset value the command does not set are spelled out (the same run
    as on the demo, another model)."""
    if a.model_preset == "demo":
        return cmd
    if a.model_preset == REAL:
        return with_real_model(cmd, a)
    from orlhf.config.flags import DEMO_PRESET
    from orlhf.config.validation_rollout import ENGINE_FLAGS
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    values = {
        "pretrain": str(model_folder(a)),
        "prompt_data": str(demo.prompts),
        "remote_rm_url": str(demo.reward_fn),
        **DEMO_PRESET,
    }
    given = {x for x in cmd if x.startswith("--")}
    # With the actor's ranks generating, an engine-only value given explicitly is refused (the demo preset
    # applies it only to engines), so the preset's engine values are left out there.
    no_engine = "--vllm_num_engines" in cmd and cmd[cmd.index("--vllm_num_engines") + 1] == "0"
    added = []
    for k, v in values.items():
        if f"--{k}" in given or v is False or (no_engine and k in ENGINE_FLAGS):
            continue
        added += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return [*cmd, *added]


def model_folder(a) -> Path:
    """The model both sides train: the demo's, or a preset's (built once; room for the demo's 64 + new tokens)."""
    if a.model_preset == REAL:
        return real_demo(a).model
    if a.model_preset in SIZES:
        from model_presets import bench_cache, build_model

        init = "cuda" if a.device == "cuda" else "cpu"
        return build_model(bench_cache(), *SIZES[a.model_preset], 64 + a.new_tokens, init_device=init)
    return preset_model(a.model_preset, max_len=64 + a.new_tokens)


def trl_cmd(a, python: Path) -> list[str]:
    from orlhf.demo.builder import ensure_demo

    if a.model_preset == REAL:
        demo = real_demo(a)
        data = [str(demo.train), "--reward", str(demo.reward_fn), "--input_key", "question", "--label_key", "answer"]
        data.append("--chat_template")
    else:
        demo = ensure_demo()
        data = [str(demo.prompts), "--reward", str(demo.reward_fn)]
    return [
        str(python),
        str(ROOT / "benchmarks" / "trl_grpo_runner.py"),
        "--model",
        str(model_folder(a)),
        "--prompts",
        *data,
        "--max_samples",
        str(a.max_samples),
        "--episodes",
        str(a.episodes),
        "--prompts_per_step",
        str(a.prompts_per_step),
        "--samples_per_prompt",
        str(a.samples_per_prompt),
        "--micro_batch",
        str(a.micro_batch),
        "--new_tokens",
        str(a.new_tokens),
        "--lr",
        str(a.lr),
        "--beta",
        str(a.kl),
        "--device",
        a.device,
        *(["--bf16"] if a.bf16 else []),
    ]


# ---- one run --------------------------------------------------------------------------------------------------


def run_once(
    cmd: list[str], save: Path, warmup: int, timeout: float, trl_threads: int = 0, profile: bool = False
) -> dict:
    shutil.rmtree(save, ignore_errors=True)
    save.mkdir(parents=True)
    is_trl = "trl_grpo_runner.py" in " ".join(cmd)
    cmd = [*cmd, "--out" if is_trl else "--save_path", str(save)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # orlhf starts its own Ray
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    if is_trl and trl_threads:
        env["OMP_NUM_THREADS"] = str(trl_threads)
    if not is_trl:
        paths = [str(ROOT), env.get("PYTHONPATH", "")]
        if profile:  # orlhf's processes (the driver and Ray's workers inherit it) load the phase wrappers
            paths.insert(0, str(rank_profiler_hook(save / "profile_hook")))
        env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    if profile:
        env[PROFILE_ENV] = str(save / "profile.jsonl")
    launched, steal0 = time.monotonic(), steal_seconds()
    rc, sampler = run_sampled(cmd, ROOT, save / "run.log", env, timeout, marker=None if is_trl else "startup.json")
    if rc != 0:
        tail = (save / "run.log").read_text(errors="replace").strip().splitlines()[-8:]
        return {"error": f"exit {rc}; see {save / 'run.log'}: " + " | ".join(tail)}
    rows = [json.loads(line) for line in open(save / "metrics.jsonl") if line.strip()]
    result = figures(rows, sampler, warmup, launched)
    # CPU time the hypervisor gave to other guests while this run wanted it (/proc/stat "steal"): on a shared VM
    # it slows whichever side it lands on, so a run with a high share is a noisy one
    result["steal_share"] = (steal_seconds() - steal0) / ((time.monotonic() - launched) * (os.cpu_count() or 1))
    if (save / "startup.json").exists():  # orlhf's own start-up breakdown (orlhf/launch/startup_clock.py)
        result["startup_phases"] = json.loads((save / "startup.json").read_text())["phases_s"]
    if sampler.cpu_at_marker:  # CPU seconds each process group spent before step 1 (where start-up's CPU goes)
        result["startup_cpu_s"] = {g: round(v, 2) for g, v in sorted(sampler.cpu_at_marker.items())}
    if profile:
        result["profile"] = phase_profile(save / "profile.jsonl", len(rows))
    return result


def steal_seconds() -> float:
    """Seconds of CPU stolen from this (virtual) machine so far, all cores (0 where /proc/stat has no steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def figures(rows: list[dict], sampler: TreeSampler, warmup: int, launched: float) -> dict:
    """One run's figures from its metrics rows and the sampler's row arrival times and CPU seconds."""
    if len(rows) <= warmup or len(sampler.row_times) < len(rows):
        return {"error": f"{len(rows)} metrics rows ({len(sampler.row_times)} seen landing); need > {warmup}"}
    measured = rows[warmup:]
    t = sampler.row_times
    cpu = [sum(c.values()) for c in sampler.cpu_at_rows]
    # From the end of the warm-up (or the start of step 1 without warm-up) to the last row.
    t_from = t[warmup - 1] if warmup else t[0] - rows[0]["step_s"]
    cpu_from = cpu[warmup - 1] if warmup else 0.0
    wall = t[len(rows) - 1] - t_from
    cores = os.cpu_count() or 1
    cpu_s = cpu[len(rows) - 1] - cpu_from
    phases = sorted({k for r in measured for k in r if k.startswith("timing/")})
    lengths = all("response_length" in r for r in measured)
    return {
        "samples_per_s": statistics.median(r["samples"] / r["step_s"] for r in measured),
        "startup_s": t[0] - rows[0]["step_s"] - launched,
        "busy_share": cpu_s / (wall * cores) if wall > 0 else float("nan"),
        "cpu_s_per_step": cpu_s / len(measured),
        "cpu_s_per_step_by_group": per_group_cpu(sampler.cpu_at_rows, warmup, len(rows)),
        "step_s": statistics.median(r["step_s"] for r in measured),
        "phases": {k[7:]: statistics.median(r.get(k, 0.0) for r in measured) for k in phases},
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
        "steps_measured": len(measured),
        **({"response_length": statistics.median(r["response_length"] for r in measured)} if lengths else {}),
    }


def per_group_cpu(cpu_at_rows: list[dict], warmup: int, n: int) -> dict:
    """CPU seconds per measured step of each process group (driver, RankActor, EngineActor, ...)."""
    last, first = cpu_at_rows[n - 1], cpu_at_rows[warmup - 1] if warmup else {}
    return {g: round((last[g] - first.get(g, 0.0)) / (n - warmup), 3) for g in sorted(last)}


def median_of(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "no runs"}
    out = {k: statistics.median(r[k] for r in ok) for k in ok[0] if isinstance(ok[0][k], (int, float))}
    for key in ("phases", "startup_phases", "startup_cpu_s", "cpu_s_per_step_by_group"):
        if key in ok[0]:
            out[key] = {k: statistics.median(r[key].get(k, 0.0) for r in ok) for k in ok[0][key]}
    out["repeats"] = len(ok)
    if len(ok) < len(runs):
        out["errors"] = [r["error"] for r in runs if "error" in r]
    return out


# ---- main -----------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    from orlhf.demo.builder import default_cache_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--modes", default=None, help=f"comma list of {MODES} (default: all on cpu, {','.join(GPU_MODES)} on cuda)"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="both sides' device (cuda: bf16)")
    ap.add_argument("--bf16", action="store_true", help="both sides in mixed precision on CPU too (always on cuda)")
    ap.add_argument("--profile", action="store_true", help="one more run per mode, each phase under the torch profiler")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="steps not measured at the start of each run")
    add_work_args(ap)
    ap.add_argument(
        "--model_preset",
        choices=(*PRESETS, *SIZES, REAL),
        default=None,
        help="the model both sides train (benchmarks/model_presets.py; e.g. medium: ~20M params; 0.4b: 380M; "
        f"{REAL}: SmolLM2-135M-Instruct on its addition task, `orlhf make-demo --real`); default demo on cpu, "
        "0.4b on cuda",
    )
    ap.add_argument("--kl", type=float, default=0.01, help="KL coefficient (TRL beta); 0: no reference model")
    ap.add_argument("--orlhf_flags", default="", help="extra train-ppo flags for the orlhf modes")
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more orlhf mode: sync orlhf with these train-ppo flags, e.g. "
        "'zero2=--zero_stage 2' (repeatable; runs after --modes in each repeat)",
    )
    ap.add_argument(
        "--trl_threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS for TRL (default: unset, torch's one thread per core, as a user runs it)",
    )
    ap.add_argument("--trl_version", default=TRL_VERSION)
    ap.add_argument("--trl_venv", type=Path, default=None, help="default: <orlhf cache>/trl-venv-<version>")
    ap.add_argument("--no_install", action="store_true", help="fail instead of installing TRL's virtualenv")
    ap.add_argument(
        "--trl_python",
        type=Path,
        default=None,
        help="a python that imports trl already, used as it is (default on cuda: this python; on cpu: the venv)",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "trl_compare")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    a.bf16 = a.bf16 or cuda
    a.modes = [m for m in (a.modes or ",".join(GPU_MODES if cuda else MODES)).split(",") if m]
    a.model_preset = a.model_preset or ("0.4b" if cuda else "demo")
    if cuda and a.trl_python is None:
        a.trl_python = Path(sys.executable)
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {MODES}")
    a.extra_cmds = {}
    for spec in a.extra:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in MODES:
            ap.error(f"--extra {spec!r}: give NAME=FLAGS with a new NAME, e.g. 'zero2=--zero_stage 2'")
        a.extra_cmds[name] = tuple(flags.split())
    if a.model_preset != "demo" and any(
        f.split("=")[0] in ("--pretrain", "--prompt_data", "--remote_rm_url") for f in a.orlhf_flags.split()
    ):
        ap.error(
            "--model_preset names the model and the demo's data; leave --pretrain, --prompt_data and "
            "--remote_rm_url out of --orlhf_flags (or use --model_preset demo)"
        )
    a.trl_venv = a.trl_venv or default_cache_dir() / f"trl-venv-{a.trl_version}"
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    python = None
    if "trl" in a.modes:
        python = a.trl_python or trl_python(a.trl_venv, a.trl_version, install=not a.no_install)
        if a.trl_python and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode:
            raise SystemExit(f"--trl_python {python}: it cannot import trl; install trl there or leave out trl mode")
    cmds = {
        "orlhf": orlhf_cmd(a, False),
        "orlhf_async": orlhf_cmd(a, True),
        "orlhf_1thread": orlhf_cmd(a, False, ("--vllm_cpu_threads", "1", "--train_cpu_threads", "1")),
        "orlhf_engines2": orlhf_cmd(a, False, ("--vllm_num_engines", "2")),
        "orlhf_trainer": orlhf_cmd(a, False, ("--vllm_num_engines", "0")),
        "hybrid": hybrid_cmd(orlhf_cmd(a, False)),  # the same flags, DeepSpeed-Chat's system
        **{name: orlhf_cmd(a, False, flags) for name, flags in a.extra_cmds.items()},
    }
    cmds = {m: with_model(c, a) for m, c in cmds.items()}
    cmds["trl"] = trl_cmd(a, python) if python else None
    modes = [*a.modes, *a.extra_cmds]
    machine = machine_facts(a)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(a.repeats):
        for mode in modes:
            print(f"repeat {rep + 1}/{a.repeats}: {mode} ...", flush=True)
            runs[mode].append(run_once(cmds[mode], a.out / f"{mode}-r{rep}", a.warmup, a.timeout, a.trl_threads))
    result = {m: median_of(rs) for m, rs in runs.items()}
    add_ratios(result, runs)
    for mode in modes if a.profile else ():
        print(f"profiled run: {mode} ...", flush=True)
        run = run_once(cmds[mode], a.out / f"{mode}-profile", a.warmup, a.timeout, a.trl_threads, profile=True)
        result[mode]["profile"] = run.get("profile", {"error": run.get("error")})
    add_rates(a, result, machine)
    print_table(result)
    print_rooflines(result, machine)
    report_line(a, result)
    print(
        json.dumps(
            {
                "modes": result,
                "runs": runs,
                "kl": a.kl,
                "device": a.device,
                "gpu": gpu_name() if a.device == "cuda" else None,
                "model_preset": a.model_preset,
                "model": str(model_folder(a)),
                "trl_version": a.trl_version,
                "steps": a.max_samples // a.prompts_per_step * a.episodes,
                "warmup": a.warmup,
                "cores": os.cpu_count(),
                "load_avg": os.getloadavg(),
                "machine": machine,
            }
        )
    )


def machine_facts(a) -> dict:
    """The CPU (lscpu's model and flags) and, on CPU, the roofline: fp32 torch.mm's rate on all cores, measured
    before the runs (benchmarks/roofline.py)."""
    cores = os.cpu_count() or 1
    rate = roofline.fp32_matmul_rate(cores) if a.device == "cpu" else None
    return {"cpu": roofline.cpu_facts(), "fp32_mm_gflop_s": rate, "fp32_mm_threads": cores, "load_avg": os.getloadavg()}


def add_rates(a, result: dict, machine: dict) -> None:
    """Each mode's GFLOP/s per phase against the roofline (roofline.add_mode_rates); on CPU only."""
    if not machine["fp32_mm_gflop_s"]:
        return
    if a.model_preset == REAL:
        demo = real_demo(a)
        prompts = roofline.prompt_ids(str(demo.model), str(demo.train), "question", a.prompts_per_step, True)
    else:
        from orlhf.demo.builder import ensure_demo

        prompts = roofline.prompt_ids(
            str(model_folder(a)), str(ensure_demo().prompts), "prompt", a.prompts_per_step, False
        )
    work = {"samples_per_prompt": a.samples_per_prompt, "micro_batch": a.micro_batch, "new_tokens": a.new_tokens}
    roofline.add_mode_rates(result, str(model_folder(a)), prompts, work, machine["fp32_mm_gflop_s"])


def print_rooflines(result: dict, machine: dict) -> None:
    cpu = machine["cpu"]
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, kernel flags {' '.join(cpu['kernel_flags'])}")
    if cpu.get("isa_limits"):
        print(f"instruction sets limited by: {' '.join(f'{k}={v}' for k, v in cpu['isa_limits'].items())}")
    roof = machine["fp32_mm_gflop_s"]
    if not roof:
        return
    print(f"roofline: fp32 torch.mm 2048^2 on {machine['fp32_mm_threads']} threads {roof} GFLOP/s")
    for m, r in result.items():
        for phase, f in (r.get("rates") or {}).items():
            print(
                f"{m} {phase}: {f['gflop']} GFLOP in {f['s']} s = {f['gflop_s']} GFLOP/s, "
                f"{100 * f['of_roofline']:.0f}% of the roofline"
            )


def report_line(a, result: dict) -> None:
    """A short line for $ORLHF_GPU_REPORT (scripts/gpu_check.sh prints that file): each mode's samples/s, ratio to
    TRL and profile."""
    path = os.environ.get("ORLHF_GPU_REPORT")
    if not path:
        return
    keep = ("samples_per_s", "ratio_vs_trl", "ratio_vs_trl_paired", "step_s", "startup_s", "phases", "profile", "error")
    line = {
        "test": "trl_compare",
        "device": a.device,
        "gpu": gpu_name() if a.device == "cuda" else None,
        "model_preset": a.model_preset,
        "steps": a.max_samples // a.prompts_per_step * a.episodes,
        "warmup": a.warmup,
        "modes": {m: {k: r[k] for k in keep if k in r} for m, r in result.items()},
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def add_ratios(result: dict, runs: dict[str, list[dict]]) -> None:
    """ratio_vs_trl: a mode's median samples/s over TRL's median; ratios_per_repeat: each repeat's run over the TRL
    run of the same repeat (they ran minutes apart, so a drift of the machine's speed cancels out), and their
    median, ratio_vs_trl_paired."""
    trl_sps = result.get("trl", {}).get("samples_per_s")
    if not trl_sps:
        return
    for m, r in result.items():
        if "samples_per_s" not in r:
            continue
        r["ratio_vs_trl"] = r["samples_per_s"] / trl_sps
        pairs = [(a, b) for a, b in zip(runs[m], runs["trl"]) if "samples_per_s" in a and "samples_per_s" in b]
        if pairs:
            r["ratios_per_repeat"] = [round(a["samples_per_s"] / b["samples_per_s"], 3) for a, b in pairs]
            r["ratio_vs_trl_paired"] = statistics.median(r["ratios_per_repeat"])


def print_table(result: dict) -> None:
    cols = ("samples_per_s", "ratio_vs_trl", "startup_s", "busy_share", "cpu_s_per_step", "step_s", "steal_share")
    print(f"{'mode':<14}" + "".join(f"{c:>16}" for c in cols) + "   phases (s per step)")
    for m, r in result.items():
        if "error" in r:
            print(f"{m:<14}  error: {r['error']}")
            continue
        cells = "".join(f"{r.get(c, float('nan')):>16.3f}" for c in cols)
        print(f"{m:<14}{cells}   " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    for m, r in result.items():
        if "startup_phases" in r:
            print(f"{m} start-up, s: " + ", ".join(f"{k} {v:.1f}" for k, v in r["startup_phases"].items()))
        if "startup_cpu_s" in r:
            print(
                f"{m} start-up, CPU s by process group: "
                + ", ".join(f"{k} {v:.1f}" for k, v in r["startup_cpu_s"].items())
                + f" (sum {sum(r['startup_cpu_s'].values()):.1f})"
            )
        if r.get("ratios_per_repeat") and m != "trl":
            print(
                f"{m} vs TRL per repeat: "
                + ", ".join(f"{x:.2f}x" for x in r["ratios_per_repeat"])
                + f" (median {r['ratio_vs_trl_paired']:.2f}x)"
            )
        for phase, f in (r.get("profile") or {}).items():
            if isinstance(f, dict):
                print(f"{m} profiled, per step: {phase} GPU {f['gpu_s']} s, wall {f['wall_s']} s, {f['calls']} calls")
        if r.get("cpu_s_per_step_by_group"):
            print(
                f"{m} CPU s per step by process group: "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_s_per_step_by_group"].items())
            )


if __name__ == "__main__":
    main()
