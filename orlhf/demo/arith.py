"""The real-model demo: SmolLM2-135M-Instruct (demo/real_model.py) learning to add, with a held-out test split.

    orlhf make-demo --real DIR  writes
        DIR/model/          the converted model (files hard-linked from the cache where the filesystem allows)
        DIR/train.jsonl     TRAIN rows {"question": "What is 47 + 8? Answer with the number only.", "answer": "55"}
        DIR/test.jsonl      TEST_SIZE rows of pairs that are in no train row (--eval_dataset)
        DIR/reward_func.py  a copy of demo/arith_reward.py: 1.0 when the response's last integer is the sum
    and prints RECIPE_FLAGS as a command line.

Why this task: a rule checks it; the model starts low but not at zero (its greedy answers are right about one time
in nine: it often writes the sum wrongly or talks past the token budget), so a policy gradient has something to
sharpen; and the test split holds pairs (A, B) the run never trains on, so a better test score is learning to
add, not remembering answers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from orlhf.demo.real_model import ensure_real_model

QUESTION = "What is {a} + {b}? Answer with the number only."
A_RANGE = range(10, 100)  # a two-digit number ...
B_RANGE = range(1, 10)  # ... plus a one-digit one: 810 pairs in all
TEST_SIZE = 200
# The recipe `make-demo --real` prints: GRPO (group-normalised advantages over 8 samples a prompt, no critic, no
# reference model: KL off), sampling at 0.7 so groups disagree, greedy evaluation on the test split every 5 steps
# and before the first, 24 new tokens (an answer and a little working), the engines in eager mode (compiling costs
# more start-up than the run's few steps win back on a CPU).
RECIPE_FLAGS: dict[str, object] = {
    "input_key": "question",
    "label_key": "answer",
    "apply_chat_template": True,
    "advantage_estimator": "group_norm",
    "n_samples_per_prompt": 8,
    "rollout_batch_size": 8,
    "train_batch_size": 64,
    "micro_train_batch_size": 8,
    "micro_rollout_batch_size": 16,
    "prompt_max_len": 128,
    "generate_max_len": 24,
    "temperature": 0.7,
    "actor_learning_rate": 1e-5,
    "init_kl_coef": 0,
    "num_episodes": 1,
    "max_samples": 240,
    "eval_steps": 5,
    "eval_before_train": True,
    "eval_temperature": 0,
    "eval_n_samples_per_prompt": 1,
    "enforce_eager": True,
}


@dataclass(frozen=True)
class RealDemoPaths:
    root: Path
    model: Path  # HF folder (SmolLM2-135M-Instruct, fp32)
    train: Path  # jsonl {"question", "answer"}
    test: Path  # jsonl, pairs disjoint from train's
    reward_fn: Path  # reward_func(queries, prompts, labels)

    @classmethod
    def under(cls, root: Path) -> RealDemoPaths:
        return cls(root, root / "model", root / "train.jsonl", root / "test.jsonl", root / "reward_func.py")


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every (a, b) once, shuffled by `seed`: (train, test) with TEST_SIZE test pairs and no pair in both."""
    pairs = [(a, b) for a in A_RANGE for b in B_RANGE]
    random.Random(seed).shuffle(pairs)
    return pairs[TEST_SIZE:], pairs[:TEST_SIZE]


def rows(pairs: list[tuple[int, int]]) -> list[dict]:
    return [{"question": QUESTION.format(a=a, b=b), "answer": str(a + b)} for a, b in pairs]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the model is 0.5 GB: share the cache's bytes where the filesystem allows
    except OSError:
        shutil.copy2(src, dst)


def make_real_demo(out_dir: Path, seed: int = 0, cache_dir: Path | None = None) -> RealDemoPaths:
    """Write the real-model demo into out_dir (the model fetched and converted into the cache on first use)."""
    paths = RealDemoPaths.under(Path(out_dir).resolve())
    model = ensure_real_model(cache_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    if paths.model.exists():
        shutil.rmtree(paths.model)
    shutil.copytree(model, paths.model, copy_function=_link_or_copy)
    train, test = split_pairs(seed)
    for path, pairs in ((paths.train, train), (paths.test, test)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(pairs)))
    shutil.copyfile(Path(__file__).with_name("arith_reward.py"), paths.reward_fn)
    return paths


def train_command(paths: RealDemoPaths, save_path: str = "./runs/smollm2-add") -> str:
    """The `orlhf train-ppo` command line of the recipe on the demo at `paths`."""
    flags = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in RECIPE_FLAGS.items())
    inputs = f"--pretrain {paths.model} --prompt_data {paths.train} --eval_dataset {paths.test}"
    return f"orlhf train-ppo {inputs} {flags} --remote_rm_url {paths.reward_fn} --save_path {save_path}"
