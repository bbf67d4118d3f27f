"""Model workers: plain classes, one per role, usable with or without Ray (a rank actor holds one).

    PolicyWorker     actor: log_probs, train_step (PPO), named_full_weights, state_dict_full, save_hf; with LoRA
                     (lora.py) also base_log_probs, the reference; with --enable_ema a moving average (ema.py)
    ReferenceWorker  frozen actor copy: log_probs
    CriticWorker     values, train_step (clipped value loss)
    RewardWorker     scores (value head on the last real token)

Construct with the role's WorkerConfig, then call init() on all ranks at once (see base.py).
"""

from orlhf.workers.causal_lm import ReferenceWorker
from orlhf.workers.critic import CriticWorker
from orlhf.workers.policy import PolicyWorker
from orlhf.workers.scorer import RewardWorker

__all__ = ["PolicyWorker", "ReferenceWorker", "CriticWorker", "RewardWorker"]
