"""trl_compare.py's hybrid mode: the DeepSpeed-Chat-style baseline (hybrid_engine_baseline.py) run with the sync orlhf
mode's command line, so the two do the same work by construction.

The baseline accepts every `orlhf train-ppo` flag and builds its config the same way (the demo preset without
--pretrain; the real model's data, chat template and reward file with them), so only the program changes: the same
python, the baseline's script in place of `-m orlhf.cli train-ppo`, every flag kept. Flags the baseline has no use
for (vLLM's, e.g. --enforce_eager; placement) it ignores; those it cannot honour (--async_train) it refuses with a
line naming the flag, which trl_compare reports as the mode's error.
"""

from __future__ import annotations

from pathlib import Path

BASELINE = Path(__file__).resolve().parent / "hybrid_engine_baseline.py"
TRAIN_PPO = ("-m", "orlhf.cli", "train-ppo")


def hybrid_cmd(orlhf_cmd: list[str]) -> list[str]:
    """[python, -m, orlhf.cli, train-ppo, *flags] -> [python, hybrid_engine_baseline.py, *flags]."""
    python, *rest = orlhf_cmd
    if tuple(rest[: len(TRAIN_PPO)]) != TRAIN_PPO:
        raise ValueError(f"not an orlhf train-ppo command: {orlhf_cmd[:5]}")
    return [python, str(BASELINE), *rest[len(TRAIN_PPO) :]]
