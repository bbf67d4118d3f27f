"""Where a run's numbers go: <save_path>/metrics.jsonl always, wandb and TensorBoard when asked, reward.png.

One JSON object per step (the controller's dict: step, reward_mean, kl, policy_loss, value_loss, samples_per_s,
weight_version, timing/<phase>, ...). The file is appended and flushed per step, so a crash loses nothing
already logged and a resumed run continues the same file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, save_path: str, *, use_wandb: Optional[str] = None, wandb_project: str = "orlhf",
                 wandb_run_name: Optional[str] = None, use_tensorboard: Optional[str] = None,
                 config: Optional[dict] = None, resume: bool = False, wandb_org: Optional[str] = None,
                 wandb_group: Optional[str] = None):
        self.dir = Path(save_path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if not resume and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file; resume appends
        self._file = open(self.path, "a")
        self._wandb = self._tb = None
        if use_wandb is not None:
            import wandb

            if use_wandb:  # OpenRLHF passes the API key as the flag's value
                os.environ.setdefault("WANDB_API_KEY", use_wandb)
            self._wandb = wandb.init(project=wandb_project, dir=str(self.dir),
                                     name=wandb_run_name or time.strftime("ppo-%Y%m%d-%H%M%S"),
                                     config=config or {}, resume="allow" if resume else None,
                                     entity=wandb_org, group=wandb_group)
        if use_tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(use_tensorboard or str(self.dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)

    def close(self) -> Optional[Path]:
        """Flush everything and draw reward.png from metrics.jsonl. Returns the PNG path (None if no steps)."""
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        return plot_rewards(self.path, self.dir / "reward.png")


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a missing value shows the gap honestly
    return v


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_rewards(metrics_path: Path, out: Path) -> Optional[Path]:
    rows = [r for r in read_metrics(metrics_path) if r.get("reward_mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    rewards = [r["reward_mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker=".", label="reward_mean")
    k = max(1, len(rows) // 10)
    if len(rows) > k:
        smooth = [sum(rewards[max(0, i - k + 1):i + 1]) / len(rewards[max(0, i - k + 1):i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"mean of last {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("orlhf PPO: mean reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
