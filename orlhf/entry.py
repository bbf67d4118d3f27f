"""What `orlhf train-ppo` runs once its flags are a valid TrainConfig."""

from __future__ import annotations

import logging

from orlhf.config import TrainConfig

log = logging.getLogger("orlhf")


def train_ppo(cfg: TrainConfig) -> int:
    """Run PPO with `cfg`. Returns the process exit code."""
    # The PPO loop (placement, workers, engines, controller) lands in later issues; until then this entry
    # point validates and reports, and says plainly that it trained nothing.
    p, v = cfg.placement, cfg.vllm
    print("[orlhf] flags are valid. Planned layout:")
    for role, present in (("actor", True), ("ref", True), ("critic", cfg.has_critic), ("reward", cfg.has_reward_model)):
        if present:
            print(f"  {role:7s} {getattr(p, f'{role}_num_nodes')} node(s) x {getattr(p, f'{role}_num_gpus_per_node')} rank(s)")
    print(f"  vllm    {v.num_engines} engine(s) x TP {v.tensor_parallel_size}")
    print(f"  model   {'built-in tiny demo' if cfg.data.uses_demo else cfg.data.pretrain}; "
          f"estimator {cfg.ppo.advantage_estimator}")
    print("[orlhf] NOT TRAINED: the PPO loop is not implemented yet in this version; stopped after validation.")
    return 0
