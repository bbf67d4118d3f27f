"""Where a run's numbers go: <save_path>/metrics.jsonl always, wandb and TensorBoard when asked, reward.png.

One JSON object per step (the controller's dict: step, reward_mean, kl, policy_loss, value_loss, samples_per_s,
weight_version, timing/<phase>, ...). The file is appended and flushed per step, so a crash loses nothing
already logged and a resumed run continues the same file.

Resume (resume_step = the checkpoint's step): the steps logged after that checkpoint, before the crash, are
trained again, so they are cut from metrics.jsonl first (rewritten to a temp file, fsynced, renamed over it:
a crash mid-trim leaves the old file whole); W&B continues the same run (run id = the checkpoint's run id) and
TensorBoard's writer purges its events past resume_step, so no step appears twice anywhere. A truncated last
line (a crash mid-write) is dropped with a warning, never an error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from orlhf.config.redact import redact_argv
from orlhf.storage.run_folder import RunFolder

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(
        self,
        save_path: str,
        *,
        use_wandb: Optional[str] = None,
        wandb_project: str = "orlhf",
        wandb_run_name: Optional[str] = None,
        use_tensorboard: Optional[str] = None,
        config: Optional[dict] = None,
        resume: bool = False,
        resume_step: Optional[int] = None,
        run_id: Optional[str] = None,
        wandb_org: Optional[str] = None,
        wandb_group: Optional[str] = None,
    ):
        self.dir = Path(save_path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.folder = RunFolder(self.dir)
        self.path = self.folder.metrics
        resume = resume or resume_step is not None
        if not resume and self.path.exists():
            self.path.unlink()  # a fresh run starts a fresh file; resume appends
        if resume_step is not None and self.path.exists():
            trim_metrics(self.path, resume_step)
        self._file = open(self.path, "a")
        self._wandb = self._tb = None
        if use_wandb is not None:
            import wandb

            if use_wandb:  # OpenRLHF passes the API key as the flag's value
                os.environ.setdefault("WANDB_API_KEY", use_wandb)
            if use_wandb:  # it stays out of the config that goes to W&B (redacted by the caller) and of the logs
                log.warning(
                    "--use_wandb KEY: the key is visible to anyone who can list this machine's processes; "
                    "prefer `export WANDB_API_KEY=...` (or `wandb login`) and a bare --use_wandb"
                )
            argv, sys.argv = sys.argv, redact_argv(sys.argv)  # W&B stores the command line in its metadata
            try:
                self._wandb = wandb.init(
                    project=wandb_project,
                    dir=str(self.dir),
                    id=run_id,
                    name=wandb_run_name or time.strftime("ppo-%Y%m%d-%H%M%S"),
                    config=config or {},
                    resume="allow" if resume else None,
                    entity=wandb_org,
                    group=wandb_group,
                )
            finally:
                sys.argv = argv
        if use_tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard discards this folder's earlier events at steps >= it (the re-trained ones)
            self._tb = SummaryWriter(
                use_tensorboard or str(self.folder.tensorboard),
                purge_step=resume_step + 1 if resume_step is not None else None,
            )

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

    def close(self, plot: bool = True) -> Optional[Path]:
        """Flush and close every sink, then (plot=True) draw reward.png, best effort. Returns the PNG path or None.
        train-ppo passes plot=False and calls plot() after the final model is exported."""
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        return self.plot() if plot else None

    def plot(self) -> Optional[Path]:
        """reward.png from metrics.jsonl, best effort: a plotting failure is logged, never raised (it must not
        cost a run its final model). Returns the PNG path, or None."""
        try:
            return plot_rewards(self.path, self.folder.reward_curve)
        except Exception as e:  # matplotlib missing or broken, a disk full, an odd metrics file: only the curve
            log.warning("reward curve not drawn (%s: %s); the numbers are in %s", type(e).__name__, e, self.path)
            return None


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a missing value shows the gap honestly
    return v


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a line that is not JSON (the torn last line of a crash) is skipped, logged."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                log.warning("%s line %d is not JSON (a write cut short by a crash?): skipped", path, lineno)
    return rows


def trim_metrics(path: Path, last_step: int) -> int:
    """Keep only rows with step <= last_step (and drop torn lines), atomically. Returns how many rows were cut."""
    rows = read_metrics(path)
    kept = [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= last_step]
    tmp = path.with_name(f".{path.name}.trim-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory
    finally:
        os.close(fd)
    if len(kept) < len(rows):
        log.info(
            "%s: cut %d row(s) logged after step %d (trained again from the checkpoint)",
            path,
            len(rows) - len(kept),
            last_step,
        )
    return len(rows) - len(kept)


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
        smooth = [
            sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1])
            for i in range(len(rewards))
        ]
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
