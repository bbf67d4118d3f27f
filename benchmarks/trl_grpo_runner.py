"""TRL's GRPOTrainer on orlhf's demo, one run; benchmarks/trl_compare.py starts it with TRL's own virtualenv.

    demo model folder + first --max_samples prompts (jsonl) + the demo reward file
    -> GRPOTrainer (HF generate, no vLLM; fp32 on CPU) -> <out>/metrics.jsonl, one row per optimizer step:
       step, samples, step_s, reward_mean, timing/generate_score (TRL's _generate_and_score_completions: generate,
       reward, old/ref log-probs), timing/train (the rest of the step), t_begin (time.time() at the step's start)

Imports nothing from orlhf (orlhf is not installed in TRL's virtualenv): the reward file is loaded by path, as
orlhf loads it. The demo's reward_func(queries, prompts, labels) becomes TRL's reward(prompts, completions, label).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path


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


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("model", "prompts", "reward", "out"):
        ap.add_argument(f"--{name}", required=True)
    add_work_args(ap)
    ap.add_argument("--beta", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(args.prompts) if line.strip()][: args.max_samples]
    data = Dataset.from_list([{"prompt": r["prompt"], "label": r.get("label", "")} for r in rows])
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
        bf16=False,
        fp16=False,
        use_cpu=True,
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
    inner = trainer._generate_and_score_completions

    def generate_and_score(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            timed["generate_score"] += time.perf_counter() - t0

    trainer._generate_and_score_completions = generate_and_score
    trainer.add_callback(StepLog(out / "metrics.jsonl", samples, timed, TrainerCallback))
    trainer.train()


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
