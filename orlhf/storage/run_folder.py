"""The run folder (--save_path) and what a run writes in it: every path named here once, read by the modules that
write and read them.

    <save_path>/
      logs/                    driver.log, <role>-<rank>.log, vllm-<i>.log, reward_func.log (storage/logs.py)
      run_config.json          the resolved configuration: every setting, its value and where it came from
                               (config/provenance.py); a resume compares its flags with this one
      metrics.jsonl            one row per step (storage/metrics.py)
      startup.json             the start-up's phases and their seconds (launch/startup_clock.py)
      restarts.jsonl           --max_restarts: one row per restart (launch/restart.py)
      reward.png               the reward curve (storage/metrics.py)
      report.png, report.html  the run's figure and page (`orlhf report`, storage/report.py)
      tensorboard/             --use_tensorboard without a folder of its own
      actor/                   the final actor, an HF folder (with LoRA: the adapter) (launch/export.py)
      actor_merged/            --lora_save_merged: the actor with its adapter merged in
      critic/                  --save_value_network: the final critic, value head included
      checkpoints_ppo/         checkpoints, unless --ckpt_path puts them elsewhere (TrainConfig's checkpoint_dir;
                               storage/checkpoint.py), the best evaluation's in best/; each checkpoint holds the HF
                               actor in hf/actor and the run_config.json it was written under

A path outside this list is not part of a run's output: a run folder's reader (`orlhf report`, a resume, a user's
script) can rely on these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @classmethod
    def at(cls, save_path: Union[str, Path]) -> RunFolder:
        return cls(Path(save_path))

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def config(self) -> Path:
        return self.root / "run_config.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def startup(self) -> Path:
        return self.root / "startup.json"

    @property
    def restarts(self) -> Path:
        return self.root / "restarts.jsonl"

    @property
    def reward_curve(self) -> Path:
        return self.root / "reward.png"

    @property
    def report_png(self) -> Path:
        return self.root / "report.png"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def actor(self) -> Path:
        return self.root / "actor"

    @property
    def actor_merged(self) -> Path:
        return self.root / "actor_merged"

    @property
    def critic(self) -> Path:
        return self.root / "critic"


def best_checkpoints(checkpoints: Union[str, Path]) -> Path:
    """The best evaluation's checkpoint folder (--best_metric_key) inside the checkpoint folder."""
    return Path(checkpoints) / "best"


def checkpoint_config(checkpoint: Union[str, Path]) -> Path:
    """The resolved configuration a checkpoint was written under (the run folder's run_config.json, copied)."""
    return Path(checkpoint) / "run_config.json"


def checkpoint_hf_actor(checkpoint: Union[str, Path]) -> Path:
    """The HF actor folder inside one checkpoint."""
    return Path(checkpoint) / "hf" / "actor"
