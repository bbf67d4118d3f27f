"""The train phase of one step: --max_epochs passes over the step's experience, shuffled, with the actor and the
critic training at the same time (non-blocking calls, gathered after).

When one optimizer step takes the whole experience, the order of its rows cannot change the update: the shuffle then
moves whole prompts (each prompt's samples stay together, so a training micro-batch runs each prompt once:
workers/shared_prompt.py); otherwise it shuffles rows, as OpenRLHF's replay buffer. The order depends on (seed, step,
epoch) only, so a resumed run shuffles as the uninterrupted one did.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from orlhf.config.ppo_config import PPOConfig
from orlhf.trainer.hybrid_memory import SleepSwitch
from orlhf.trainer.step_stats import FROZEN_ACTOR_STATS, mean_stats
from orlhf.types import Experience
from orlhf.workers import CriticWorker, PolicyWorker
from orlhf.workers.shared_prompt import prompt_major_order


def train_epochs(
    exp: Experience, kl_coef: float, ppo: PPOConfig, step_index: int, actor: Any, critic: Any, sleep: SleepSwitch
) -> tuple[dict, Optional[dict]]:
    """(actor stats, critic stats or None) averaged over every optimizer step of the epochs. actor: its group, or
    None while it is frozen (--freezing_actor_steps: FROZEN_ACTOR_STATS); critic: its group, or None without one.
    kl_coef goes to the actor's KL loss (--use_kl_loss), so an adaptive coefficient reaches the loss."""
    actor_stats, critic_stats = [], []
    one_step = len(exp) <= ppo.train_batch_size
    for epoch in range(ppo.max_epochs):
        g = torch.Generator().manual_seed(ppo.seed + 7919 * step_index + epoch)
        order = prompt_major_order(exp, g) if one_step else torch.randperm(len(exp), generator=g)
        shuffled = exp.index(order)
        # both start at once (one after the other under --async_train --deepspeed_enable_sleep: hybrid_memory.py)
        actor_call = None if actor is None else sleep.train(actor, PolicyWorker.train_step, shuffled, kl_coef)
        critic_call = sleep.train(critic, CriticWorker.train_step, shuffled) if critic else None
        actor_stats += actor_call.get() if actor_call is not None else []
        if critic_call is not None:
            critic_stats += critic_call.get()
    actor_out = mean_stats(actor_stats) if actor_stats else FROZEN_ACTOR_STATS
    return actor_out, mean_stats(critic_stats) if critic_stats else None
