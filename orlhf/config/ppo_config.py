"""The PPO section of TrainConfig: the algorithm's flags (batches, estimators, KL, clipping, loss variants, sampling,
optimizer), declared once as fields that are also command-line flags (config/option.py).

Nothing here imports torch: `orlhf --help` must stay fast. The choice tuples are kept equal to orlhf/algo/losses.py's
(a unit test checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.algo.registry import ESTIMATORS
from orlhf.config.option import opt

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token_mean", "seq_mean")
POLICY_LOSS_TYPES = ("ppo", "gspo")
IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")
LR_SCHEDULERS = ("cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup")


@dataclass(frozen=True)
class PPOConfig:
    num_episodes: int = opt(1, "Passes over the prompt data.")
    rollout_batch_size: int = opt(64, "Prompts per PPO step.")
    micro_rollout_batch_size: int = opt(16, "Samples per forward pass when scoring, per rank.")
    train_batch_size: int = opt(64, "Samples per optimizer step (global).")
    micro_train_batch_size: int = opt(8, "Samples per forward/backward pass, per rank.")
    max_epochs: int = opt(1, "Passes over each step's experience.")
    prompt_max_len: int = opt(1024, "Longest prompt in tokens.")
    generate_max_len: int = opt(1024, "Most new tokens per response (OpenRLHF: --max_new_tokens).")
    max_len: Optional[int] = opt(
        None,
        "Longest prompt + response in tokens (OpenRLHF's --max_len): a response gets at most max_len - its "
        "prompt's length new tokens; without --generate_max_len / --max_new_tokens that is the only cap.",
    )
    actor_learning_rate: float = opt(1e-6, "Actor learning rate.")
    critic_learning_rate: float = opt(9e-6, "Critic learning rate.")
    lr_warmup_ratio: float = opt(0.03, "Share of optimizer steps spent in linear LR warm-up.")
    init_kl_coef: float = opt(0.01, "KL penalty coefficient (initial, if adaptive).")
    kl_target: Optional[float] = opt(None, "Target KL for an adaptive KL controller (default: none, a fixed KL coef).")
    kl_horizon: int = opt(10000, "Horizon of the adaptive KL controller.")
    kl_estimator: str = opt("k1", "KL estimator.", choices=KL_ESTIMATORS)
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a reward penalty.")
    advantage_estimator: str = opt("gae", "Advantage estimator.", choices=tuple(ESTIMATORS))
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt.")
    gamma: float = opt(1.0, "Discount factor.")
    lambd: float = opt(1.0, "GAE lambda.")
    eps_clip: float = opt(0.2, "PPO policy ratio clip.")
    value_clip: Optional[float] = opt(0.5, "Critic value clip.")
    dual_clip: Optional[float] = opt(None, "Dual-clip PPO constant (> 1).")
    normalize_reward: bool = opt(
        False,
        "Normalize rewards: with the mean/std stored in the reward model's config.json, as OpenRLHF (the "
        "critic's values too, with its own); reward sources without stored statistics (functions, URLs) use "
        "running statistics of this run's rewards.",
    )
    reward_clip_range: tuple[float, float] = opt((-10.0, 10.0), "Clip rewards to [LOW HIGH].", metavar="LOW HIGH")
    entropy_loss_coef: float = opt(0.0, "Entropy bonus coefficient.")
    temperature: float = opt(1.0, "Sampling temperature.")
    freezing_actor_steps: int = opt(
        -1,
        "Critic warm-up: the actor is not trained (and the engines not synced) while the 0-based step "
        "index is <= N, i.e. the first N+1 steps, as OpenRLHF (-1: never frozen).",
    )
    top_p: float = opt(1.0, "Nucleus sampling p.")
    seed: int = opt(42, "Random seed (engines get seed + engine index).")
    async_train: bool = opt(False, "Generate step k+1 while training on step k.")
    async_queue_size: int = opt(1, "Rollout batches that may wait between generation and training (async).")
    # ---- losses and their variants (OpenRLHF v0.10-0.11, DAPO, GSPO) ----
    loss_agg_mode: Optional[str] = opt(
        None,
        "Loss aggregation over an optimizer step: token_mean (each token weighs the same) or seq_mean (each "
        "sequence's token mean does). Default: seq_mean with --policy_loss_type gspo (as OpenRLHF), else token_mean.",
        choices=LOSS_AGG_MODES,
    )
    eps_clip_low_high: Optional[tuple[float, float]] = opt(
        None,
        "Asymmetric PPO clip [1 - LOW, 1 + HIGH] (DAPO's clip-higher, e.g. 0.2 0.28); default: --eps_clip both sides.",
        metavar="LOW HIGH",
    )
    policy_loss_type: str = opt(
        "ppo",
        "ppo: token ratios; gspo: one sequence-level ratio (geometric mean of the token ratios, GSPO).",
        choices=POLICY_LOSS_TYPES,
    )
    enable_vllm_is_correction: bool = opt(
        False, "Importance sampling (IS) correction of the gap between engine and trainer log-probs."
    )
    vllm_is_correction_type: str = opt(
        "tis",
        "tis: truncate each token's ratio to the thresholds; icepop: drop tokens outside them; "
        "seq-mask-tis: drop sequences whose geometric-mean ratio is outside them.",
        choices=IS_CORRECTION_TYPES,
    )
    vllm_is_truncated_threshold: tuple[float, float] = opt(
        (0.5, 5.0), "IS-correction thresholds LOW HIGH on pi_trainer / pi_engine.", metavar="LOW HIGH"
    )
    dynamic_filtering: bool = opt(
        False,
        "DAPO dynamic sampling: drop prompts whose samples' mean reward is outside the open "
        "reward range (the flag below); generate more until the batch is full.",
    )
    dynamic_filtering_reward_range: tuple[float, float] = opt(
        (0.0, 1.0), "Open range (LOW, HIGH) a prompt's mean reward must fall in to be kept.", metavar="LOW HIGH"
    )
    overlong_buffer_len: Optional[float] = opt(
        None,
        "DAPO soft overlong penalty: responses longer than the most new tokens minus this lose up to "
        "the penalty factor (the flag below), linearly.",
    )
    overlong_penalty_factor: float = opt(1.0, "Largest overlong penalty (at the most new tokens).")
    stop_properly_penalty_coef: Optional[float] = opt(
        None, "Responses cut at the most new tokens: in [0, 1] scales their reward; < 0 sets it to this value."
    )
    no_advantage_std_norm: bool = opt(
        False,
        "Whitened estimators (gae, reinforce, reinforce_baseline): subtract the batch mean, do not divide by the std.",
    )
    max_norm: float = opt(1.0, "Gradient clipping: largest global gradient norm.")
    adam_betas: tuple[float, float] = opt((0.9, 0.95), "Adam betas.", metavar="BETA1 BETA2")
    l2: float = opt(0.0, "Weight decay (AdamW).")
    lr_scheduler: str = opt(
        "cosine_with_min_lr",
        "LR schedule after warm-up: cosine_with_min_lr (to 10%; the "
        "default), cosine (to 0), linear (to 0), constant, constant_with_warmup.",
        choices=LR_SCHEDULERS,
        metavar="NAME",
    )
