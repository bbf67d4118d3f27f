"""The PPO section of TrainConfig: the algorithm's flags (batches, estimators, KL, clipping, loss variants, sampling,
optimizer), declared once as fields that are also command-line flags (config/option.py).

Nothing here imports torch: `orlhf --help` must stay fast. The choice tuples are kept equal to orlhf/algo/losses.py's
(a unit test checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.algo.is_correction import DEFAULTS as IS_DEFAULTS
from orlhf.algo.is_correction import IS_GATINGS, IS_LEVELS, IS_MODES, NAMED
from orlhf.algo.registry import ESTIMATORS
from orlhf.config.option import opt

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token_mean", "seq_mean")
# OpenRLHF 0.11.2's --actor.loss_agg_mode spellings, read as orlhf's
OPENRLHF_AGG_MODES = {"token-mean": "token_mean", "seq-mean-token-mean": "seq_mean"}
POLICY_LOSS_TYPES = ("ppo", "gspo")
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # verl's router_replay.mode names
IS_CORRECTION_TYPES = tuple(NAMED)  # --vllm_is_correction_type (v0.10.1 / v0.11.0)
# --partial_rollout_tokens' default: the larger of this and --generate_max_len / PARTIAL_ROLLOUT_SEGMENTS
# (benchmarks/bench_partial_rollout.py measures what a cut costs)
PARTIAL_ROLLOUT_TOKENS, PARTIAL_ROLLOUT_SEGMENTS = 256, 8
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
    kl_unbiased_gradient: bool = opt(
        False,
        "With --use_kl_loss: keep the estimator's value, backpropagate the unbiased KL gradient "
        "w * log(pi / pi_ref) * grad log pi, w = pi / pi_old at most 10 (OpenRLHF 0.11.2's "
        "--algo.kl.unbiased_gradient); k1, k2 and k3 then share one gradient.",
    )
    advantage_estimator: str = opt(
        "gae",
        f"Advantage estimator: {', '.join(ESTIMATORS)} (gae: PPO; group_norm: GRPO).",
        choices=tuple(ESTIMATORS),
        metavar="NAME",
    )
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
    aux_loss_coef: float = opt(
        0.0,
        "Mixture-of-experts models: weight of the router's load-balancing loss in the actor's loss (added per "
        "micro-batch, as OpenRLHF; 0: off).",
    )
    router_replay: str = opt(
        "disabled",
        "Mixture-of-experts actors (Qwen2-MoE, Qwen3-MoE, Mixtral): route the actor's tokens to recorded experts "
        "instead of its own routers' choice (verl's router_replay.mode; slime's --use-routing-replay and "
        "--use-rollout-routing-replay). R3: the experts the vLLM engines routed each sampled token to, in the "
        "actor's old-log-prob and training forwards, so it scores the samples with the network that sampled them; "
        "R2: the experts of the actor's own old-log-prob forward, in its training forwards. The gate weights stay "
        "the trainer's (docs/moe.md).",
        choices=ROUTER_REPLAY_MODES,
    )
    temperature: float = opt(1.0, "Sampling temperature.")
    freezing_actor_steps: int = opt(
        -1,
        "Critic warm-up: the actor is not trained (and the engines not synced) while the 0-based step "
        "index is <= N, i.e. the first N+1 steps, as OpenRLHF (-1: never frozen).",
    )
    enable_ema: bool = opt(
        False,
        "Keep an exponential moving average of the actor's trained weights (host memory, updated after every "
        "optimizer step); the final export and --save_hf_ckpt folders hold the average, as OpenRLHF.",
    )
    ema_beta: float = opt(0.992, "With --enable_ema: average = beta * average + (1 - beta) * weights, per step.")
    top_p: float = opt(1.0, "Nucleus sampling p.")
    seed: int = opt(42, "Random seed (engines get seed + engine index).")
    async_train: bool = opt(False, "Generate step k+1 while training on step k.")
    async_queue_size: int = opt(1, "Rollout batches that may wait between generation and training (async).")
    vllm_generate_batch_size: Optional[int] = opt(
        None,
        "With --async_train: prompts the engines generate in one call, a multiple of --rollout_batch_size "
        "(over-sampling ahead into the queue, as OpenRLHF; default: --rollout_batch_size).",
    )
    partial_rollout: bool = opt(
        False,
        "With --async_train: a weight sync no longer waits for the batch in generation. The engines generate in "
        "segments of at most --partial_rollout_tokens new tokens per sample; at a sync the unfinished samples go on "
        "under the new weights, so a sample may hold tokens of two weight versions (each token keeps its own "
        "log-prob and version; staleness counts its oldest). Time can be won with --async_queue_size >= 2 only (with "
        "1 the batch in generation is the one trained next). Not reproducible step for step: where syncs fall "
        "depends on timing (OpenRLHF's --partial_rollout / --train.partial_rollout_enable).",
    )
    partial_rollout_tokens: Optional[int] = opt(
        None,
        "With --partial_rollout: most new tokens per sample in one engine call, so the longest a weight sync "
        "waits for; each further segment reads its prompt and response so far again. Default: the larger of "
        f"{PARTIAL_ROLLOUT_TOKENS} and --generate_max_len / {PARTIAL_ROLLOUT_SEGMENTS} (so a long response is cut "
        f"at most {PARTIAL_ROLLOUT_SEGMENTS - 1} times).",
    )
    # ---- losses and their variants (OpenRLHF v0.10-0.11, DAPO, GSPO) ----
    loss_agg_mode: Optional[str] = opt(
        None,
        "Loss aggregation over an optimizer step, of the actor's and the critic's losses: token_mean (each token "
        "weighs the same) or seq_mean (each sequence's token mean does). Default: seq_mean with --policy_loss_type "
        "gspo (as OpenRLHF), else token_mean. Unlike OpenRLHF it also aggregates the KL-loss and entropy terms (which "
        "OpenRLHF always token-averages), so one mode weighs every term of a sample alike.",
        choices=LOSS_AGG_MODES,
    )
    actor_loss_agg_mode: Optional[str] = opt(
        None,
        "Aggregation of the actor's policy loss alone (OpenRLHF 0.11.2's --actor.loss_agg_mode, whose token-mean / "
        "seq-mean-token-mean mean token_mean / seq_mean); the KL-loss and entropy terms keep --loss_agg_mode. "
        "Default: --loss_agg_mode.",
        choices=LOSS_AGG_MODES + tuple(OPENRLHF_AGG_MODES),
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
        (0.5, 5.0),
        "IS-correction thresholds LOW HIGH on the gated statistic (pi_trainer / pi_engine, or a divergence: 0 HIGH).",
        metavar="LOW HIGH",
    )
    is_correction_level: Optional[str] = opt(
        None,
        "IS correction as OpenRLHF 0.11.2 (--algo.advantage.is_correction_level): off, token (each token is gated) or "
        "seq (each sequence's mean statistic is; mask mode only). Default: off, or what --enable_vllm_is_correction "
        "with --vllm_is_correction_type asks for (tis = token clip, icepop = token mask, seq-mask-tis = seq mask).",
        choices=IS_LEVELS,
    )
    is_correction_mode: Optional[str] = opt(
        None,
        "mask: a unit outside the thresholds gets weight 0, one inside keeps its tokens' pi_trainer / pi_engine; "
        "clip: each token's weight is clamped to the thresholds (token level, ratio gating). Default: mask.",
        choices=IS_MODES,
    )
    is_correction_gating: Optional[str] = opt(
        None,
        "The gated statistic: ratio (pi_trainer / pi_engine), or binary_kl / tv, a divergence between the engine's "
        "and the trainer's probability of the sampled token (a trust region: thresholds 0 HIGH). Default: ratio.",
        choices=IS_GATINGS,
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

    def is_correction_choice(self) -> tuple[str, str, str]:
        """The IS correction's (level, mode, gating), algo/is_correction.py: --vllm_is_correction_type's scheme
        under --enable_vllm_is_correction, else the --is_correction_* flags with OpenRLHF 0.11.2's defaults (off,
        mask, ratio). Validation refuses the two spellings asking for different corrections."""
        if self.enable_vllm_is_correction:
            return NAMED[self.vllm_is_correction_type]
        return self.is_correction_given()

    def is_correction_given(self) -> tuple[str, str, str]:
        """What the --is_correction_* flags alone ask for, 0.11.2's defaults where one is not given."""
        given = (self.is_correction_level, self.is_correction_mode, self.is_correction_gating)
        return tuple(g if g is not None else d for g, d in zip(given, IS_DEFAULTS))

    @property
    def partial_rollout_segment(self) -> int:
        """--partial_rollout: the most new tokens per sample in one engine call (its flag, else the default)."""
        if self.partial_rollout_tokens is not None:
            return self.partial_rollout_tokens
        return max(PARTIAL_ROLLOUT_TOKENS, -(-self.generate_max_len // PARTIAL_ROLLOUT_SEGMENTS))

    @property
    def is_correction_enabled(self) -> bool:
        """An IS correction is on (either spelling): the actor needs the engines' log-probs."""
        return self.is_correction_choice()[0] != "off"
