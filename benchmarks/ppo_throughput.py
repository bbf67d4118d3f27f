"""PPO throughput: the DeepSpeed-Chat-style hybrid baseline against orlhf's modes, same flags, one invocation.

    settings (+ --preset) -> ONE flag list, given to every mode (model, prompts, reward, batch sizes, lengths, LRs)
    for repeat: for mode:                 interleaved, so machine-load drift hits every mode alike
        hybrid        benchmarks/hybrid_engine_baseline.py FLAGS [--hybrid_flags: --world_size --gather ...]
        hybrid_ws2    the same with --world_size 2 --threads 1 (two SPMD ranks: on 2 cores, one per core)
        split         orlhf train-ppo FLAGS                       (one device per role + one vLLM engine)
        colocate      orlhf train-ppo FLAGS --colocate_actor_ref [--colocate_critic_reward with an RM]
        colocate_all  orlhf train-ppo FLAGS --colocate_all_models (models and engine share the actor's devices)
        async         orlhf train-ppo FLAGS --async_train
        <mode>+<knob>  the same mode with one speed-up's flags appended (KNOBS: padded, pack, mb_small, mb_full,
                       engines2, engine_threads, rank_threads, zero0, adam_offload), compared with <mode> in its own
                       table: each speed-up measured on vs off in one invocation (--modes ablation: all of them)
      each a subprocess with <out>/<mode>-r<k>/ as --save_path; while it runs proctree.TreeSampler sums the RSS of
      its process tree per group (driver, ray::RankActor, ray::EngineActor, hybrid ranks, Ray system, ...)
      every 0.25 s and keeps each group's peak, and notes when each metrics.jsonl row appears
    -> per mode: the rows after --warmup: samples/s = sum(samples) / sum(step_s); seconds per phase
       (timing/<phase>, averaged per step); the median over repeats; speedup_vs_hybrid = samples/s / hybrid's,
       speedup_vs_best_hybrid against the fastest baseline run (hybrid, hybrid_ws2 or hybrid+<knob>)
    -> a table, <out>/ppo_throughput.png, and one final JSON line with every figure

Steps: --max_samples = rollout_batch_size x (warmup + steps) and --num_episodes 1, so each run makes exactly
warmup + steps PPO steps on the same prompts in the same order. Start-up (Ray, vLLM, DeepSpeed) is not counted.
wall_samples_per_s is a check from outside: measured samples over the time between the arrival of the last
warm-up row and the last row (it holds for async mode, where a step's own timings overlap).

On CPU every "GPU" is a Ray CPU slot, so colocation only changes placement bookkeeping: all processes share the
same cores either way, and other jobs on the machine show up in every number (see load_avg in the JSON).

Reproduce (2-core CPU box; ~4 min for the defaults, ~11 min with --repeats 3; gen_heavy ~2.5x that):
    .venv/bin/python benchmarks/ppo_throughput.py --repeats 3
    .venv/bin/python benchmarks/ppo_throughput.py --preset gen_heavy --repeats 2
    .venv/bin/python benchmarks/ppo_throughput.py --hidden 512 --layers 4 --modes hybrid,split
    .venv/bin/python benchmarks/ppo_throughput.py --model_preset medium --modes hybrid,split      # ~20M params
    .venv/bin/python benchmarks/ppo_throughput.py --modes ablation --repeats 2     # every knob on vs off, ~16 min
One GPU node (8 GPUs; DeepSpeed-Chat on all 8, orlhf split 2 actor + 2 critic + 2 ref + 2 engines):
    python benchmarks/ppo_throughput.py --device cuda --modes hybrid,split,colocate_all \\
        --pretrain MODEL --generate_max_len 512 --rollout_batch_size 256 --common_flags "--bf16" \\
        --hybrid_flags "--world_size 8 --hybrid_engine --adam_offload --ref_reward_offload" \\
        --orlhf_flags "--actor_num_gpus_per_node 2 --critic_num_gpus_per_node 2 --ref_num_gpus_per_node 2 \\
                       --vllm_num_engines 2" --colocate_all_flags "--actor_num_gpus_per_node 8 \\
                       --critic_num_gpus_per_node 8 --ref_num_gpus_per_node 8 --vllm_num_engines 8"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from model_presets import PRESETS as MODEL_PRESETS  # noqa: E402  (benchmarks/model_presets.py)
from model_presets import build_model, preset_model  # noqa: E402
from proctree import RSS_GROUPS, TreeSampler, run_sampled  # noqa: E402  (benchmarks/proctree.py)

from orlhf.config import flags as F  # noqa: E402

MODES = ("hybrid", "hybrid_ws2", "split", "colocate", "colocate_all", "async")
# hybrid_ws2: the baseline as 2 SPMD ranks of 1 thread each. On a 2-core box that is DeepSpeed-Chat using both
# "devices", like orlhf's processes do; plain hybrid is one process using both cores through torch threads.
HYBRID_WS2 = ["--world_size", "2", "--threads", "1"]
PHASES = ("generate", "score", "make_experience", "train", "sync")
# Knobs: "<mode>+<knob>[+<knob>]" runs <mode> with the knob's flags appended (later flags win), so each speed-up
# is measured on vs off in the same invocation. f(values) -> (extra argv, what the knob does).
KNOBS = {
    "padded": lambda v: (["--no_trim_padding"], "padding removal OFF (micro-batches padded to the step's longest)"),
    "pack": lambda v: (["--packing_samples"], "samples packed into one row per micro-batch (no padding at all)"),
    "mb_small": lambda v: (
        ["--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4"],
        "micro-batches of 4 (train and scoring)",
    ),
    "mb_full": lambda v: (
        [
            "--micro_train_batch_size",
            str(v["train_batch_size"]),
            "--micro_rollout_batch_size",
            str(v["rollout_batch_size"] * v.get("n_samples_per_prompt", 1)),
        ],
        "micro-batches as large as the batch (one forward/backward per step and model)",
    ),
    "engines2": lambda v: (["--vllm_num_engines", "2"], "two vLLM engines instead of one (more devices to generation)"),
    "engine_threads": lambda v: (
        ["--vllm_cpu_threads", str(os.cpu_count() or 1)],
        "CPU: each vLLM engine runs as many torch threads as the machine has cores",
    ),
    "rank_threads": lambda v: (
        ["--train_cpu_threads", str(os.cpu_count() or 1)],
        "CPU: each model rank runs as many torch threads as the machine has cores",
    ),
    "zero0": lambda v: (["--zero_stage", "0"], "ZeRO stage 0 instead of 3 (no parameter partitioning hooks)"),
    "adam_offload": lambda v: (["--adam_offload"], "Adam states on the host: DeepSpeedCPUAdam (pinned on GPUs)"),
}
# --modes ablation: every knob against its base, one run each.
ABLATION = (
    "hybrid",
    "hybrid+padded",
    "hybrid+mb_full",
    "split",
    "split+padded",
    "split+pack",
    "split+mb_small",
    "split+mb_full",
    "split+engines2",
    "split+engine_threads",
    "split+rank_threads",
    "split+adam_offload",
    "async",
    "async+mb_full",
)
# Regimes. default: the demo's preset (24 new tokens). gen_heavy: long responses to short prompts, as in real
# RLHF, where generation dominates a step.
PRESETS = {"default": {}, "gen_heavy": {"generate_max_len": 256, "prompt_max_len": 64}}


def log(msg: str) -> None:
    print(f"[ppo_throughput] {msg}", file=sys.stderr, flush=True)


# ---- settings -> one flag list --------------------------------------------------------------------------------


def common_values(args) -> dict:
    """Every train-ppo flag both sides get, all explicit (the demo preset spelled out, so a --pretrain model
    gets the same settings as the demo would)."""
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    values = {k: v for k, v in F.DEMO_PRESET.items() if k != "num_episodes"}
    values.update(PRESETS[args.preset])
    for k in (
        "prompt_max_len",
        "generate_max_len",
        "rollout_batch_size",
        "n_samples_per_prompt",
        "train_batch_size",
        "micro_train_batch_size",
        "micro_rollout_batch_size",
        "advantage_estimator",
        "seed",
    ):
        if getattr(args, k) is not None:
            values[k] = getattr(args, k)
    model = args.pretrain or str(demo.model)
    max_len = values["prompt_max_len"] + values["generate_max_len"]
    if args.pretrain is None and args.hidden is not None:
        model = str(build_model(Path(args.out), args.hidden, args.layers, max_len))
    elif args.pretrain is None and args.model_preset != "demo":
        model = str(preset_model(args.model_preset, max_len=max_len))
    device = args.device
    if device == "auto":  # resolved here so the JSON says what ran; both sides would resolve it the same way
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    values.update(
        pretrain=model,
        prompt_data=args.prompt_data or str(demo.prompts),
        device=device,
        num_episodes=1,
        max_samples=values["rollout_batch_size"] * (args.warmup + args.steps),
    )
    if args.reward_pretrain:
        values["reward_pretrain"] = args.reward_pretrain
    else:
        values["remote_rm_url"] = args.remote_rm_url or str(demo.reward_fn)
    return values


def model_name(path: str) -> str:
    p = Path(path)
    return p.parent.name if p.name == "model" else p.name  # the demo's folder is <cache>/demo-v1/model


def to_argv(values: dict) -> list[str]:
    argv = []
    for k, v in values.items():
        if isinstance(v, bool):
            argv += [f"--{k}"] if v else []
        elif isinstance(v, (list, tuple)):
            argv += [f"--{k}", *map(str, v)]
        elif v is not None:
            argv += [f"--{k}", str(v)]
    return argv


def split_mode(mode: str) -> tuple[str, list[str]]:
    """ "split+pack+mb_full" -> ("split", ["pack", "mb_full"])."""
    base, *knobs = mode.split("+")
    return base, knobs


def knob_argv(knobs: list[str], values: dict) -> list[str]:
    return [a for k in knobs for a in KNOBS[k](values)[0]]


def mode_argv(mode: str, values: dict, args) -> list[str]:
    """The mode's command. orlhf's own validation runs in the subprocess: an invalid combination exits 2 before
    anything starts and is reported as skipped with orlhf's message (run_once)."""
    mode, knobs = split_mode(mode)
    return [*_base_argv(mode, values, args), *knob_argv(knobs, values)]


def _base_argv(mode: str, values: dict, args) -> list[str]:
    common = shlex.split(args.common_flags)
    if mode in ("hybrid", "hybrid_ws2"):
        return [
            sys.executable,
            str(ROOT / "benchmarks" / "hybrid_engine_baseline.py"),
            *to_argv(values),
            *common,
            *shlex.split(args.hybrid_flags),
            *(HYBRID_WS2 if mode == "hybrid_ws2" else []),
        ]
    extra = {
        "split": [],
        "colocate": ["--colocate_actor_ref"] + (["--colocate_critic_reward"] if values.get("reward_pretrain") else []),
        "colocate_all": ["--colocate_all_models"],
        "async": ["--async_train"],
    }[mode]
    own = args.colocate_all_flags if mode == "colocate_all" and args.colocate_all_flags else args.orlhf_flags
    return [sys.executable, "-m", "orlhf.cli", "train-ppo", *to_argv(values), *common, *shlex.split(own), *extra]


# ---- one run: a subprocess, its process tree's memory, its metrics rows ----------------------------------------


def run_once(mode: str, cmd: list[str], save: Path, warmup: int, timeout: float) -> dict:
    """Run one mode; returns its figures, or {"error": ...} / {"skipped": ...}."""
    import shutil

    shutil.rmtree(save, ignore_errors=True)
    save.mkdir(parents=True)
    cmd = [*cmd, "--save_path", str(save)]
    (save / "cmd.txt").write_text(shlex.join(cmd) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # each orlhf run starts its own Ray
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    t0 = time.monotonic()
    rc, sampler = run_sampled(cmd, ROOT, save / "run.log", env, timeout)
    wall = time.monotonic() - t0
    text = (save / "run.log").read_text(errors="replace")
    if rc == 2 and "problem(s) with the flags" in text:  # orlhf's validation refused the mode's flags
        return {"skipped": " ".join(line.strip(" -") for line in text.splitlines() if line.startswith("  - "))}
    if rc != 0:
        return {"error": f"exit {rc}; see {save / 'run.log'}: " + " | ".join(text.strip().splitlines()[-6:])}
    rows = [json.loads(line) for line in open(save / "metrics.jsonl") if line.strip()]
    return summarize_rows(rows, sampler, warmup, wall, t0)


def summarize_rows(rows: list[dict], sampler: TreeSampler, warmup: int, wall: float, t0: float) -> dict:
    measured = rows[warmup:]
    if not measured:
        return {"error": f"{len(rows)} metrics rows, none after {warmup} warm-up steps"}
    samples, seconds = sum(r["samples"] for r in measured), sum(r["step_s"] for r in measured)
    tokens = sum(r["samples"] * r["response_length"] for r in measured)  # sampled lengths differ a little by side
    phases = sorted({k[7:] for r in measured for k in r if k.startswith("timing/")})
    times = sampler.row_times
    wall_sps = (
        samples / (times[-1] - times[warmup - 1])
        if warmup >= 1 and len(times) == len(rows) and times[-1] > times[warmup - 1]
        else None
    )
    cpu = sampler.cpu_at_rows
    cpu_per_step = (
        {g: (cpu[-1].get(g, 0.0) - cpu[warmup - 1].get(g, 0.0)) / len(measured) for g in cpu[-1]}
        if warmup >= 1 and len(cpu) == len(rows)
        else {}
    )
    return {
        "samples_per_s": samples / seconds,
        "wall_samples_per_s": wall_sps,
        "step_s": seconds / len(measured),
        "response_tokens_per_s": tokens / seconds,
        "phases": {p: statistics.fmean(r.get(f"timing/{p}", 0.0) for r in measured) for p in phases},
        "steps_measured": len(measured),
        "samples_per_step": measured[0]["samples"],
        "response_length": statistics.fmean(r["response_length"] for r in measured),
        "rewards": [round(r["reward_mean"], 4) for r in rows],  # every step, warm-up included
        "startup_s": (times[0] - t0 - rows[0]["step_s"]) if times else None,
        "wall_s": wall,
        "peak_rss_gb": {g: round(sampler.peak[g] / 2**30, 3) for g in RSS_GROUPS if g in sampler.peak},
        "processes": {g: sampler.procs[g] for g in RSS_GROUPS if g in sampler.procs},
        "peak_rss_total_gb": round(sampler.peak_total / 2**30, 3),
        # CPU seconds per measured step, per process group, and their sum: on a C-core machine a step of s
        # seconds has C x s core-seconds to spend; cpu_busy = total / (C x step_s) is the share it used.
        "cpu_s_per_step": {g: round(v, 3) for g, v in cpu_per_step.items() if v > 0.0005},
        "cpu_s_per_step_total": round(sum(cpu_per_step.values()), 3) if cpu_per_step else None,
        "largest_other_process": sampler.other[1] or None,
    }


def combine(runs: list[dict]) -> dict:
    """Repeats of one mode -> medians (throughput, phases), max (memory); every repeat's samples/s kept."""
    med = statistics.median
    out = dict(runs[len(runs) // 2])  # non-numeric fields from one run (rewards of the median-ish repeat)
    out["samples_per_s"] = med(r["samples_per_s"] for r in runs)
    walls = [r["wall_samples_per_s"] for r in runs if r["wall_samples_per_s"] is not None]
    out["wall_samples_per_s"] = med(walls) if walls else None
    out["step_s"] = med(r["step_s"] for r in runs)
    out["response_tokens_per_s"] = med(r["response_tokens_per_s"] for r in runs)
    out["phases"] = {p: med(r["phases"].get(p, 0.0) for r in runs) for p in runs[0]["phases"]}
    groups = [g for g in RSS_GROUPS if any(g in r["peak_rss_gb"] for r in runs)]
    out["peak_rss_gb"] = {g: max(r["peak_rss_gb"].get(g, 0.0) for r in runs) for g in groups}
    out["processes"] = {g: max(r["processes"].get(g, 0) for r in runs) for g in groups}
    out["peak_rss_total_gb"] = max(r["peak_rss_total_gb"] for r in runs)
    out["samples_per_s_runs"] = [round(r["samples_per_s"], 3) for r in runs]
    cpu_groups = sorted({g for r in runs for g in r.get("cpu_s_per_step", {})})
    out["cpu_s_per_step"] = {g: med(r.get("cpu_s_per_step", {}).get(g, 0.0) for r in runs) for g in cpu_groups}
    totals = [r["cpu_s_per_step_total"] for r in runs if r.get("cpu_s_per_step_total") is not None]
    out["cpu_s_per_step_total"] = med(totals) if totals else None
    return out


# ---- report ----------------------------------------------------------------------------------------------------


def markdown(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def tables(results: dict, speedup: dict) -> str:
    """Speed and phases (seconds per step, averaged over measured steps), then peak RSS per process group."""
    speed = [
        [
            "mode",
            "samples/s",
            "vs hybrid",
            "wall samples/s",
            "resp tokens/s",
            "step s",
            *PHASES,
            "start-up s",
            "reward first -> last step",
        ]
    ]
    for mode, r in results.items():
        wall = r["wall_samples_per_s"]
        speed.append(
            [
                mode,
                f"{r['samples_per_s']:.1f}",
                f"{speedup[mode]:.2f}x",
                f"{wall:.1f}" if wall else "-",
                f"{r['response_tokens_per_s']:.0f}",
                f"{r['step_s']:.2f}",
                *(f"{r['phases'][p]:.2f}" if p in r["phases"] else "-" for p in PHASES),
                f"{r['startup_s']:.0f}" if r["startup_s"] is not None else "-",
                f"{r['rewards'][0]:.3f} -> {r['rewards'][-1]:.3f}",
            ]
        )
    memory = [["mode", "total GiB", *(f"{g} GiB (procs)" for g in RSS_GROUPS)]]
    for mode, r in results.items():
        memory.append(
            [
                mode,
                f"{r['peak_rss_total_gb']:.2f}",
                *(
                    f"{r['peak_rss_gb'][g]:.2f} ({r['processes'][g]})" if g in r["peak_rss_gb"] else "-"
                    for g in RSS_GROUPS
                ),
            ]
        )
    cores = os.cpu_count() or 1
    cpu = [["mode", "CPU s per step", f"busy (of {cores} cores)", *(f"{g} CPU s" for g in RSS_GROUPS)]]
    for mode, r in results.items():
        total = r.get("cpu_s_per_step_total")
        if total is None:
            continue
        cpu.append(
            [
                mode,
                f"{total:.2f}",
                f"{total / (cores * r['step_s']):.0%}",
                *(f"{r['cpu_s_per_step'][g]:.2f}" if g in r["cpu_s_per_step"] else "-" for g in RSS_GROUPS),
            ]
        )
    return (
        markdown(speed)
        + "\n\npeak RSS, summed per group (the peak of each group's sum over the run):\n"
        + markdown(memory)
        + "\n\nCPU seconds per measured step, per process group (user + system):\n"
        + markdown(cpu)
    )


def knob_table(results: dict, values: dict) -> Optional[str]:
    """Each "<mode>+<knobs>" against its <mode>: the speed-ups measured on vs off."""
    rows = [
        ["mode", "against", "what changes", "samples/s", "base samples/s", "ratio", "score s", "train s", "generate s"]
    ]
    for mode, r in results.items():
        base, knobs = split_mode(mode)
        if not knobs or base not in results:
            continue
        b = results[base]
        rows.append(
            [
                mode,
                base,
                "; ".join(KNOBS[k](values)[1] for k in knobs),
                f"{r['samples_per_s']:.1f}",
                f"{b['samples_per_s']:.1f}",
                f"{r['samples_per_s'] / b['samples_per_s']:.2f}x",
                *(
                    f"{b['phases'].get(p, 0):.2f} -> {r['phases'].get(p, 0):.2f}"
                    for p in ("score", "train", "generate")
                ),
            ]
        )
    return markdown(rows) if len(rows) > 1 else None


def plot(results: dict, speedup: dict, out: Path, title: str) -> Optional[Path]:
    """Throughput (bars: median, whiskers: min..max over repeats), seconds per phase, peak RSS."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    modes = list(results)
    x = range(len(modes))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    sps = [results[m]["samples_per_s"] for m in modes]
    runs = [results[m]["samples_per_s_runs"] for m in modes]
    err = [[max(0.0, s - min(r)) for s, r in zip(sps, runs)], [max(0.0, max(r) - s) for s, r in zip(sps, runs)]]
    bars = ax.bar(x, sps, yerr=err, capsize=4, color="#4c72b0")
    for b, m in zip(bars, modes):
        ax.annotate(
            f"{speedup[m]:.2f}x",
            (b.get_x() + b.get_width() / 2, 0),
            ha="center",
            va="bottom",
            color="white",
            fontweight="bold",
        )
    ax.set_title("samples/s (median; whiskers: min..max of repeats)")
    ax = axes[1]
    bottom = [0.0] * len(modes)
    colors = dict(zip(PHASES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")))
    for p in PHASES:
        h = [results[m]["phases"].get(p, 0.0) for m in modes]
        hatch = ["//" if (split_mode(m)[0] == "async" and p == "generate") else "" for m in modes]
        for i in x:
            ax.bar(i, h[i], bottom=bottom[i], color=colors[p], hatch=hatch[i], label=p if i == 0 else None)
        bottom = [a + b for a, b in zip(bottom, h)]
    ax.scatter(
        list(x), [results[m]["step_s"] for m in modes], marker="_", s=900, color="black", zorder=3, label="step (wall)"
    )
    ax.set_title("seconds per step by phase (async: generate overlaps, hatched)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    ax.bar(x, [results[m]["peak_rss_total_gb"] for m in modes], color="#dd8452")
    ax.set_title("peak RSS of each run's process tree (GiB)")
    for a in axes:
        a.set_xticks(list(x), modes, rotation=20)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = out / "ppo_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main ------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--modes",
        default="hybrid,hybrid_ws2,split,colocate_all,async",
        help=f"comma-separated, from {MODES}, each optionally with +knob from {tuple(KNOBS)} "
        f"(e.g. split+mb_full); 'ablation' = {','.join(ABLATION)}",
    )
    p.add_argument("--warmup", type=int, default=2, help="steps run and dropped before measuring")
    p.add_argument("--steps", type=int, default=5, help="measured steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved; medians reported")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", default=str(ROOT / "runs" / "ppo_throughput"), help="run folders, logs, the PNG")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    g = p.add_argument_group("model and data (default: the built-in demo)")
    g.add_argument("--pretrain", default=None, help="HF model folder (actor, ref, critic init)")
    g.add_argument("--hidden", type=int, default=None, help="build a random Llama of this width (demo tokenizer)")
    g.add_argument("--layers", type=int, default=2, help="its layers (with --hidden)")
    g.add_argument(
        "--model_preset",
        choices=tuple(MODEL_PRESETS),
        default="demo",
        help="a named size from benchmarks/model_presets.py (built once, cached); e.g. medium: ~20M",
    )
    g.add_argument("--prompt_data", default=None)
    g.add_argument("--remote_rm_url", default=None, help="reward function file / URL (default: the demo's)")
    g.add_argument("--reward_pretrain", default=None, help="a reward model instead of the function")
    g = p.add_argument_group("PPO settings (default: the demo preset, then --preset)")
    for k, t in (
        ("prompt_max_len", int),
        ("generate_max_len", int),
        ("rollout_batch_size", int),
        ("n_samples_per_prompt", int),
        ("train_batch_size", int),
        ("micro_train_batch_size", int),
        ("micro_rollout_batch_size", int),
        ("advantage_estimator", str),
        ("seed", int),
    ):
        g.add_argument(f"--{k}", type=t, default=None)
    g = p.add_argument_group("extra flags, as one quoted string each (later flags win)")
    g.add_argument("--common_flags", default="", help="train-ppo flags for every mode, e.g. '--bf16'")
    g.add_argument("--hybrid_flags", default="", help="the baseline's, e.g. '--world_size 2 --threads 1'")
    g.add_argument("--orlhf_flags", default="", help="orlhf modes', e.g. '--actor_num_gpus_per_node 2'")
    g.add_argument("--colocate_all_flags", default="", help="colocate_all's instead of --orlhf_flags")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.modes == ["ablation"]:
        args.modes = list(ABLATION)
    bad = [m for m in args.modes if split_mode(m)[0] not in MODES or any(k not in KNOBS for k in split_mode(m)[1])]
    if bad or "hybrid" not in args.modes:
        p.error(
            f"--modes: unknown {bad}: modes are {MODES}, optionally +{'/+'.join(KNOBS)}"
            if bad
            else "--modes must include hybrid (the reference for speed-ups)"
        )
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step pays one-off costs)")
    if args.model_preset != "demo" and (args.pretrain or args.hidden):
        p.error(f"--model_preset {args.model_preset} names the model, and so do --pretrain/--hidden: give one")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    values = common_values(args)
    load_start = os.getloadavg()
    log(f"settings: {shlex.join(to_argv(values))}")
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    for k in range(args.repeats):
        for mode in args.modes:
            if mode in skipped or mode in failed:
                continue
            cmd = mode_argv(mode, values, args)
            log(f"{mode} (repeat {k + 1}/{args.repeats}): running")
            r = run_once(mode, cmd, out / f"{mode}-r{k}", args.warmup, args.timeout)
            if "skipped" in r or "error" in r:
                (skipped if "skipped" in r else failed)[mode] = r.get("skipped") or r["error"]
                log(f"{mode}: {'skipped' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r['error']}")
                continue
            runs[mode].append(r)
            log(
                f"{mode}: {r['samples_per_s']:.1f} samples/s, {r['step_s']:.2f} s/step, start-up "
                f"{r['startup_s'] or 0:.0f} s, rewards {r['rewards']}"
            )
    results = {m: combine(rs) for m, rs in runs.items() if rs}
    if "hybrid" not in results:
        raise SystemExit(f"the hybrid baseline did not run: {failed.get('hybrid') or skipped.get('hybrid')}")
    base = results["hybrid"]["samples_per_s"]
    speedup = {m: r["samples_per_s"] / base for m, r in results.items()}
    best = max(r["samples_per_s"] for m, r in results.items() if m.startswith("hybrid"))
    title = (
        f"{values['rollout_batch_size'] * values.get('n_samples_per_prompt', 1)} samples/step, prompt<="
        f"{values['prompt_max_len']}, gen<={values['generate_max_len']}, model {model_name(values['pretrain'])}, "
        f"{args.steps} steps after {args.warmup} warm-up, median of {args.repeats}"
    )
    print(title)
    print(tables(results, speedup))
    knobs = knob_table(results, values)
    if knobs:
        print("\nspeed-ups, each on vs off (same invocation, same flags otherwise):")
        print(knobs)
    if any(split_mode(m)[0] == "async" for m in results):
        print(
            "async: generate runs beside score/train (its seconds are not on the step's critical path); step s "
            "is the wall time between step ends"
        )
    for mode, why in {**skipped, **failed}.items():
        print(f"{mode}: {'skipped' if mode in skipped else 'FAILED'}: {why}")
    png = plot(results, speedup, out, title)
    print(
        json.dumps(
            {
                "benchmark": "ppo_throughput",
                "preset": args.preset,
                "device": values["device"],
                "flags": values,
                "warmup": args.warmup,
                "steps": args.steps,
                "repeats": args.repeats,
                "modes": results,
                "speedup_vs_hybrid": {m: round(s, 3) for m, s in speedup.items()},
                "knob_speedups": {
                    m: round(r["samples_per_s"] / results[split_mode(m)[0]]["samples_per_s"], 3)
                    for m, r in results.items()
                    if split_mode(m)[1] and split_mode(m)[0] in results
                },
                "speedup_vs_best_hybrid": {m: round(r["samples_per_s"] / best, 3) for m, r in results.items()},
                "skipped": skipped,
                "failed": failed,
                "load_avg_start": [round(x, 2) for x in load_start],
                "load_avg_end": [round(x, 2) for x in os.getloadavg()],
                "cpu_count": os.cpu_count(),
                "png": str(png) if png else None,
            }
        )
    )


if __name__ == "__main__":
    main()
