"""`orlhf train-ppo --vllm_num_engines 0` as a user runs it (a subprocess, its own local Ray), on the one GPU.

The actor's ranks generate (HF generate, no vLLM), so this needs torch, transformers, DeepSpeed and Ray only: what
scripts/gpu_check.sh carries to a bare CUDA machine. The model is a random ~400M Llama built on the machine
(benchmarks/model_presets.build_model, hidden 1536 x 16 layers: bench_train_mfu.py's 0.4b), trained in bf16 on
the demo's prompts and reward for a few steps per run:

    colocated     GAE: actor, reference and critic each in its own rank process, all on the one GPU
                  (--colocate_all_models; split placement gives the critic a pool of its own, a second GPU:
                  `orlhf plan` says "needs 2 GPUs" for --colocate_actor_ref with a critic on one GPU), with
                  --full_determinism (on CUDA) so that the resume below can be compared bit for bit
    resume        the same flags, stopped after half the steps (--save_steps), then --load_checkpoint: the
                  resumed steps equal the uninterrupted run's, and the run's HF export reloads in transformers
                  with finite log-probs
    sleep         --colocate_all_models --deepspeed_enable_sleep (the critic's ZeRO-3 states leave the GPU while
                  the actor generates; FusedAdam, compiled on first use)
    adam_offload  GRPO with a KL loss, actor + reference on the GPU (--colocate_actor_ref), Adam states on the
                  host (--adam_offload: DeepSpeedCPUAdam, compiled on first use)

Every run: exit 0, the mean reward rises (the mean of its later half of steps above that of its first half:
a loose check, a handful of steps of a random model), the terminal holds orlhf's lines and one progress bar only
(tests/e2e/test_terminal.py's rule), and one JSON line goes to $ORLHF_GPU_REPORT: flags, steps, samples/s, the
peak GPU memory nvidia-smi saw (all processes: orlhf's metrics hold no memory figure) against `orlhf plan`'s
per-GPU estimate for the same flags.

Without CUDA the module skips, unless ORLHF_GPU_CLI_ON_CPU=1: then the same runs go on CPU (--device cpu, the demo
model, fp32) to check this file itself. Not marked `gpu` (the root conftest skips those without CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_helpers import GpuMemoryPoller, gpu_report, installed, plan_gib, terminal_lines

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
ON_CPU = os.environ.get("ORLHF_GPU_CLI_ON_CPU") == "1"
DEVICE = "cuda" if CUDA else "cpu"


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.ray,
    pytest.mark.skipif(not (CUDA or ON_CPU), reason="needs a CUDA GPU (ORLHF_GPU_CLI_ON_CPU=1 runs it on CPU)"),
    pytest.mark.skipif(not installed("ray"), reason="needs Ray (scripts/gpu_check.sh installs its stripped wheel)"),
    pytest.mark.skipif(not installed("deepspeed"), reason="needs DeepSpeed"),
]

STEPS = 8  # 256 prompts / 32 a step, one episode; steps are cheap next to a run's start-up
HALF = STEPS // 2
LLAMA_400M = (1536, 16)  # hidden, layers: benchmarks/bench_train_mfu.py's "0.4b" (380M parameters)
GAE = ["--advantage_estimator", "gae"]
GRPO = ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--train_batch_size", "128"]
GRPO += ["--use_kl_loss", "--kl_estimator", "k3"]
# CUDA's bf16 kernels (atomics in backward passes) differ run to run without deterministic ones; CPU kernels do
# not (tests/e2e's resume test needs no flag), and the flag makes CPU steps several times slower.
DETERMINISM = ["--full_determinism"] if CUDA else []
RUNS = {
    "colocated": [*GAE, "--colocate_all_models", *DETERMINISM],
    "sleep": [*GAE, "--colocate_all_models", "--deepspeed_enable_sleep"],
    "adam_offload": [*GRPO, "--colocate_actor_ref", "--adam_offload"],
}
# Metrics a resumed step must reproduce (everything the step computed; not its timings).
RESUMED = ("reward_mean", "kl", "policy_loss", "value_loss", "response_length", "entropy", "actor_grad_norm")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The ~400M Llama on CUDA (initialized on the GPU: seconds), the demo's own model on CPU. Built in a
    subprocess, as everything here that touches the GPU: this process holds no CUDA memory that a run's peak
    would count."""
    from orlhf.demo.builder import ensure_demo

    if not CUDA:
        return ensure_demo().model
    out = tmp_path_factory.mktemp("models")
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); from model_presets import build_model; "
        f"print(build_model({str(out)!r}, *{LLAMA_400M}, max_len=128, init_device='cuda'))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return Path(res.stdout.strip().splitlines()[-1])


def common_flags(model: Path) -> list[str]:
    """The demo's prompts, reward and lengths on `model`; 8 steps of 32 prompts, one optimizer step each."""
    from orlhf.demo.builder import ensure_demo

    demo = ensure_demo()
    flags = ["--device", DEVICE, "--pretrain", str(model), "--prompt_data", str(demo.prompts)]
    flags += ["--remote_rm_url", str(demo.reward_fn), "--input_key", "prompt", "--label_key", "label"]
    flags += ["--prompt_max_len", "64", "--generate_max_len", "24", "--max_samples", str(32 * STEPS)]
    flags += ["--num_episodes", "1", "--rollout_batch_size", "32", "--micro_rollout_batch_size", "32"]
    flags += ["--train_batch_size", "32", "--micro_train_batch_size", "16", "--lr_warmup_ratio", "0"]
    # the demo's preset rates; the CPU demo model (0.6M parameters) learns in a few steps only at a higher one
    flags += ["--actor_learning_rate", "5e-4" if CUDA else "2e-3", "--critic_learning_rate", "1e-3", "--seed", "42"]
    return [*flags, "--vllm_num_engines", "0", *(["--bf16"] if CUDA else [])]


def gpu() -> tuple[str, float]:
    """(name, GiB) of GPU 0 from nvidia-smi (not torch: this process stays off the GPU); ("cpu", 80) on CPU, a
    nominal H100 for the plan."""
    if not CUDA:
        return "cpu", 80.0
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
    ).stdout
    name, mib = out.strip().rsplit(",", 1)
    return name.strip(), float(mib) / 1024


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # train-ppo starts its own Ray
    out.update(DS_ACCELERATOR=DEVICE, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", COLUMNS="100")
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return out


def train(name: str, save: Path, model: Path, flags: list[str], timeout: float = 420 if CUDA else 900) -> list[dict]:
    """One `orlhf train-ppo` subprocess (common_flags + `flags`): exit 0, orlhf's lines only on the terminal; its
    metrics rows."""
    cmd = [sys.executable, "-m", "orlhf.cli", "train-ppo", "--save_path", str(save), *common_flags(model), *flags]
    t0 = time.monotonic()
    with GpuMemoryPoller() as mem:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)
    wall = time.monotonic() - t0
    (save.parent / f"{name}.terminal.txt").write_text(res.stdout + res.stderr)
    assert res.returncode == 0, f"{name}: exit {res.returncode}; logs in {save / 'logs'}\n{res.stderr[-4000:]}"
    other, bar = terminal_lines(res.stdout + res.stderr)
    assert all(line.startswith("[orlhf]") for line in other), f"{name}: not orlhf's lines:\n" + "\n".join(other)
    assert bar, f"{name}: no progress bar on the terminal"
    rows = [json.loads(line) for line in open(save / "metrics.jsonl") if line.strip()]
    report(name, model, flags, rows, wall, mem.peak_mib)
    return rows


def report(name: str, model: Path, flags: list[str], rows: list[dict], wall: float, peak_mib) -> None:
    """One JSON line for $ORLHF_GPU_REPORT: speed, peak memory and `orlhf plan`'s estimate for the same flags."""
    device, gb = gpu()
    run_only = {"--save_steps", "--stop_after_steps"}
    plan_flags = [f for i, f in enumerate(flags) if f not in run_only and (i == 0 or flags[i - 1] not in run_only)]
    plan_flags = [f for f in common_flags(model) + plan_flags if f not in ("--load_checkpoint", "--device", DEVICE)]
    where = [] if CUDA else ["--nodes", "1", "--gpus_per_node", "1"]  # on CPU: the one-GPU machine, described
    plan = subprocess.run(
        [sys.executable, "-m", "orlhf.cli", "plan", "--device", "cuda", "--gpu_memory_gb", f"{gb:.1f}", *where]
        + plan_flags,
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        cwd=ROOT,
    )
    pools = plan_gib(plan.stdout)
    measured = rows[1:] or rows  # step 1 carries warm-up (first CUDA kernels, allocator growth)
    gpu_report(
        f"cli_{name}",
        {
            "device": device,
            "flags": " ".join(flags),
            "model": "0.4b" if CUDA else "demo",
            "steps": len(rows),
            "samples_per_s": round(statistics.median(r["samples"] / r["step_s"] for r in measured), 2),
            "step_s": round(statistics.median(r["step_s"] for r in measured), 3),
            "wall_s": round(wall, 1),
            "rewards": [round(r["reward_mean"], 4) for r in rows],
            "peak_gpu_gib": None if peak_mib is None else round(peak_mib / 1024, 2),
            "plan_gib": pools,
            "plan_total_gib": round(sum(pools.values()), 2) if pools else None,
            "plan_exit": plan.returncode,  # 0 fits, 1 does not; 2 a flag it refused (plan_error)
            **({"plan_error": plan.stderr.strip()[-300:]} if plan.returncode > 1 else {}),
            "gpu_memory_gb": round(gb, 1),
        },
    )


def assert_reward_rises(name: str, rows: list[dict]) -> None:
    """Loose: the later half's mean reward above the first half's. A few steps of a random model move its reward
    by little more than the step-to-step noise of 32 prompts, so no stronger claim (a slope, a ratio) holds."""
    r = [row["reward_mean"] for row in rows]
    first, later = r[: len(r) // 2], r[len(r) // 2 :]
    assert statistics.mean(later) > statistics.mean(first), f"{name}: reward did not rise: {[round(x, 4) for x in r]}"


@pytest.fixture(scope="module")
def colocated(model, tmp_path_factory) -> tuple[Path, list[dict]]:
    save = tmp_path_factory.mktemp("colocated") / "run"
    return save, train("colocated", save, model, RUNS["colocated"])


def test_colocated_gae_run(colocated):
    _, rows = colocated
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all("value_loss" in r for r in rows)  # the critic trained
    assert_reward_rises("colocated", rows)


def test_resumed_steps_equal_the_uninterrupted_ones(model, colocated, tmp_path):
    _, full = colocated
    save = tmp_path / "run"
    flags = [*RUNS["colocated"], "--save_steps", str(HALF)]
    first = train("resume_first", save, model, [*flags, "--stop_after_steps", str(HALF)])
    assert [r["step"] for r in first] == list(range(1, HALF + 1))
    rows = train("resume_rest", save, model, [*flags, "--load_checkpoint"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Bit-equal: on CUDA both runs use --full_determinism (deterministic kernels in every rank, cuBLAS's fixed
    # workspace), the same bf16 kernels on the same GPU, and the checkpoint carries the CUDA generators' states,
    # so a resumed step repeats the uninterrupted one exactly; a tolerance would hide a missing RNG or optimizer
    # state.
    for a, b in zip(full[HALF:], rows[HALF:]):
        for key in RESUMED:
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))


EXPORT_CHECK = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, device = sys.argv[1:]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
tok = AutoTokenizer.from_pretrained(folder)
ids = tok(["say colors: cat run blue", "say colors: red tree"], return_tensors="pt", padding=True).to(device)
with torch.no_grad():
    logits = model(**ids).logits.float()  # (B, T, V)
logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids.input_ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
logp = logp[ids.attention_mask[:, 1:].bool()]
assert torch.isfinite(logp).all() and (logp <= 0).all(), logp
print(model.dtype, tuple(logits.shape), float(logp.mean()))
"""


def test_the_export_reloads_in_transformers(colocated):
    save, _ = colocated
    res = subprocess.run(
        [sys.executable, "-c", EXPORT_CHECK, str(save / "actor"), DEVICE],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("name", ["sleep", "adam_offload"])
def test_run(name, model, tmp_path):
    rows = train(name, tmp_path / "run", model, RUNS[name])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert_reward_rises(name, rows)
