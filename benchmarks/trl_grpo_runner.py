"""TRL's GRPOTrainer on orlhf's demo, one run; benchmarks/trl_compare.py starts it with TRL's own virtualenv
(--device cpu) or a python that already imports trl (--device cuda: the GPU machine has no package index).

    demo model folder + first --max_samples prompts (jsonl) + the demo reward file
    -> GRPOTrainer (HF generate, no vLLM; fp32 on CPU unless --bf16; on CUDA, and with --bf16, fp32 weights under
       bf16 autocast: TRL's `bf16=True`)
    -> <out>/metrics.jsonl, one row per optimizer step:
       step, samples, step_s, reward_mean, timing/generate_score (TRL's _generate_and_score_completions: generate,
       reward, old/ref log-probs), timing/train (the rest of the step), t_begin (time.time() at the step's start)

Imports nothing from orlhf (orlhf is not installed in TRL's virtualenv): the reward file is loaded by path, as
orlhf loads it. The demo's reward_func(queries, prompts, labels) becomes TRL's reward(prompts, completions, label).

Profiling (trl_compare.py --profile): with $TRL_COMPARE_PROFILE naming a JSON-lines file, each phase call runs
under the torch profiler and appends {"phase", "pid", "gpu_s" (its CUDA kernels' summed time; null on CPU),
"wall_s"}: here generate_score and train (forward + backward, and the optimizer step); in orlhf's rank processes
(install_rank_profiler, loaded there by the sitecustomize.py of rank_profiler_hook) generate, score and train.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

PROFILE_ENV = "TRL_COMPARE_PROFILE"


def add_work_args(ap: argparse.ArgumentParser) -> None:
    """The work both sides do (trl_compare.py passes the same values to orlhf and to this runner)."""
    ap.add_argument("--max_samples", type=int, default=384)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--prompts_per_step", type=int, default=64)
    ap.add_argument("--samples_per_prompt", type=int, default=4)
    ap.add_argument("--micro_batch", type=int, default=64)
    ap.add_argument("--new_tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=5e-4)


def load_reward(path: str, seen: list):
    """TRL's reward signature around the demo's; each call's rewards are appended to `seen` (for the log)."""
    spec = importlib.util.spec_from_file_location("demo_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def reward(prompts, completions, label=None, **_):
        labels = label if label is not None else [""] * len(prompts)
        queries = [p + c for p, c in zip(prompts, completions)]
        out = [float(x) for x in module.reward_func(queries, list(prompts), list(labels))]
        seen.extend(out)
        return out

    return reward


# ---- profiling (trl_compare.py --profile) ---------------------------------------------------------------------

_active = threading.local()  # a profiled call in progress on this thread: calls inside it are counted in it


class PhaseProfile:
    """One phase call under the torch profiler: start(), the work, stop() appends {"phase", "pid", "gpu_s",
    "wall_s"} to `path`. A start() inside another profiled call does nothing (the torch profiler does not nest;
    the outer one counts the inner call's kernels)."""

    def __init__(self, phase: str, path: str):
        self.phase, self.path, self.prof = phase, path, None

    def start(self) -> None:
        if getattr(_active, "on", False):
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.cuda = torch.cuda.is_available()
        _active.on = True
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []))
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.prof is None:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        prof, self.prof, _active.on = self.prof, None, False
        row = {"phase": self.phase, "pid": os.getpid(), "gpu_s": kernel_seconds(prof) if self.cuda else None}
        with open(self.path, "a") as f:
            f.write(json.dumps({**row, "wall_s": wall}) + "\n")


def profiled(phase: str, fn, path: str):
    """fn, each call a PhaseProfile of `phase`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        call = PhaseProfile(phase, path)
        call.start()
        try:
            return fn(*args, **kwargs)
        finally:
            call.stop()

    return wrapper


def kernel_seconds(prof) -> float:
    """The summed time of the CUDA kernels a profiler saw (bench_train_mfu.py's reading of its events)."""
    from torch.autograd import DeviceType

    us = [e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not us:  # a profiler build without device events: the device time of the ops' own kernels
        us = [e.self_device_time_total for e in prof.key_averages()]
    return sum(us) / 1e6


# orlhf's worker methods by phase, module -> class -> method -> phase (the rank processes run them)
ORLHF_PHASES = {
    "orlhf.workers.policy": {
        "PolicyWorker": {
            "generate": "generate",
            "generate_tokens": "generate",
            "log_probs": "score",
            "log_probs_and_base": "score",
            "train_step": "train",
        }
    },
    "orlhf.workers.causal_lm": {"ReferenceWorker": {"log_probs": "score"}},
    "orlhf.workers.critic": {"CriticWorker": {"values": "score", "train_step": "train"}},
}


def install_rank_profiler(path: str) -> None:
    """Wrap orlhf's worker methods (ORLHF_PHASES) in `profiled` as their modules are imported in this process.
    functools.wraps keeps each method's name and its @endpoint mark, so the groups' calls by reference resolve."""
    import importlib.abc
    import importlib.machinery

    class After(importlib.abc.MetaPathFinder):
        def find_spec(self, name, search_path, target=None):
            if name not in ORLHF_PHASES:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, search_path)
            if spec is None or spec.loader is None:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for cls_name, methods in ORLHF_PHASES[name].items():
                    cls = getattr(module, cls_name)
                    for method, phase in methods.items():
                        if method in vars(cls):
                            setattr(cls, method, profiled(phase, vars(cls)[method], path))

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, After())


def rank_profiler_hook(folder: Path) -> Path:
    """A folder holding a sitecustomize.py that installs trl_grpo_runner.install_rank_profiler when
    $TRL_COMPARE_PROFILE is set: on the PYTHONPATH of an orlhf run, every process of it (the rank actors) wraps
    orlhf's worker methods as it imports them. It shadows any other sitecustomize for that run only."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"if os.environ.get({PROFILE_ENV!r}):\n"
        f"    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "    from trl_grpo_runner import install_rank_profiler\n"
        f"    install_rank_profiler(os.environ[{PROFILE_ENV!r}])\n"
    )
    return folder


def phase_profile(path: Path, steps: int) -> dict:
    """{phase: {"gpu_s", "wall_s", "calls"} per step} from a profiled run's rows (every process, every call);
    orlhf's generate + score also as generate_score, TRL's one phase for both."""
    rows = [json.loads(line) for line in open(path) if line.strip()] if path.exists() else []
    out: dict = {}
    for r in rows:
        for phase in {r["phase"], *(["generate_score"] if r["phase"] in ("generate", "score") else [])}:
            p = out.setdefault(phase, {"gpu_s": 0.0, "wall_s": 0.0, "calls": 0})
            p["gpu_s"] = None if r["gpu_s"] is None or p["gpu_s"] is None else p["gpu_s"] + r["gpu_s"]
            p["wall_s"] += r["wall_s"]
            p["calls"] += 1
    for p in out.values():
        p["gpu_s"] = None if p["gpu_s"] is None else round(p["gpu_s"] / max(steps, 1), 4)
        p["wall_s"] = round(p["wall_s"] / max(steps, 1), 4)
        p["calls"] = round(p["calls"] / max(steps, 1), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("model", "prompts", "reward", "out"):
        ap.add_argument(f"--{name}", required=True)
    add_work_args(ap)
    ap.add_argument("--beta", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--input_key", default="prompt")
    ap.add_argument("--label_key", default="label")
    ap.add_argument("--chat_template", action="store_true", help="wrap each prompt in the model's chat template")
    ap.add_argument("--bf16", action="store_true", help="TRL's mixed precision on CPU too (always on CUDA)")
    args = ap.parse_args()
    cuda = args.device == "cuda"

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(args.prompts) if line.strip()][: args.max_samples]
    prompts = [r[args.input_key] for r in rows]
    if args.chat_template:  # the same templated text orlhf's --apply_chat_template gives its engines
        tok = AutoTokenizer.from_pretrained(args.model)
        chat = [[{"role": "user", "content": p}] for p in prompts]
        prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chat]
    labels = [str(r.get(args.label_key, "")) for r in rows]
    data = Dataset.from_list([{"prompt": p, "label": label} for p, label in zip(prompts, labels)])
    samples = args.prompts_per_step * args.samples_per_prompt
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=samples // args.micro_batch,  # one optimizer step per generation batch
        num_generations=args.samples_per_prompt,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=0,
        beta=args.beta,
        epsilon=0.2,
        num_iterations=1,
        scale_rewards="group",
        loss_type="dapo",
        num_train_epochs=args.episodes,
        bf16=cuda or args.bf16,  # fp32 weights, bf16 autocast: TRL's mixed precision
        fp16=False,
        use_cpu=not cuda,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    timed = {"generate_score": 0.0, "rewards": []}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=load_reward(args.reward, timed["rewards"]),
        args=cfg,
        train_dataset=data,
        processing_class=tokenizer,
    )
    profile = os.environ.get(PROFILE_ENV)
    inner = trainer._generate_and_score_completions
    if profile:  # per-phase GPU time: generation + scoring here; forward, backward and optimizer step as train
        inner = profiled("generate_score", inner, profile)
        trainer.compute_loss = profiled("train", trainer.compute_loss, profile)
        trainer.accelerator.backward = profiled("train", trainer.accelerator.backward, profile)
        trainer.add_callback(OptimizerStepProfile(profile, TrainerCallback))

    def generate_and_score(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            timed["generate_score"] += time.perf_counter() - t0

    trainer._generate_and_score_completions = generate_and_score
    trainer.add_callback(StepLog(out / "metrics.jsonl", samples, timed, TrainerCallback))
    trainer.train()


def OptimizerStepProfile(path: str, base):  # noqa: N802  (a class built on TRL's base at run time)
    """The optimizer step as a PhaseProfile of train: Trainer runs it between these two callbacks."""

    class _OptimizerStepProfile(base):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.call = PhaseProfile("train", path)
            self.call.start()

        def on_optimizer_step(self, args, state, control, **kw):
            self.call.stop()

    return _OptimizerStepProfile()


def StepLog(path: Path, samples: int, timed: dict, base):  # noqa: N802  (a class built on TRL's base at run time)
    class _StepLog(base):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.wall0 = time.perf_counter(), time.time()
            timed["generate_score"] = 0.0
            timed["rewards"].clear()

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            rewards = timed["rewards"]
            row = {
                "step": state.global_step,
                "samples": samples,
                "step_s": step_s,
                "samples_per_s": samples / step_s,
                "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
                "timing/generate_score": timed["generate_score"],
                "timing/train": step_s - timed["generate_score"],
                "t_begin": self.wall0,
            }
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return _StepLog()


if __name__ == "__main__":
    main()
