"""Reward shaping: from one score per sample to a reward per action token (OpenRLHF semantics).

Not the reward *sources* (reward model, remote URL, rule function): those produce `scores`, one float per sample.
The controller's order, per rollout step (B = prompts x n_samples_per_prompt, prompt-major rows):

    scores (B,)  --RunningMoments.normalize (--normalize_reward)-->  scores (B,)
                 --group_baseline(estimator)-->                      scores (B,)   centred within each prompt's group
                 --shape_rewards(kl, kl_coef, clip)-->               rewards (B, A) -kl_coef * kl per token,
                                                                                    + clipped score on the last token
                 --advantages.compute_advantages-->                  advantages, returns (B, A)

Prompt-major means sample j of prompt i is row i * n + j: OpenRLHF repeats each prompt n times in a row before
generating, and orlhf keeps that order, so a group is a block of n consecutive rows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from orlhf.algo.registry import estimator as estimator_spec

GROUP_NORM_EPS = 1e-9  # OpenRLHF's: (r - mean) / (std + 1e-9)


def shape_rewards(
    scores: torch.Tensor,  # (B,) one score per sample, after any group baseline
    kl: Optional[torch.Tensor],  # (B, A) per-token KL estimate, or None for no penalty (--use_kl_loss)
    action_mask: torch.Tensor,  # (B, A) bool, right-padded
    kl_coef: float,
    reward_clip_range: Optional[tuple[float, float]] = None,
) -> torch.Tensor:
    """Per-token reward (B, A) float32: -kl_coef * kl on every real token, plus clip(score) on the last one.

    OpenRLHF's compute_reward, with two deliberate differences:
      * padding is 0 here (OpenRLHF leaves -kl_coef * kl on padding and masks it later, in the return
        computation); the advantages come out the same.
      * a negative kl_coef raises (OpenRLHF silently treats it as 0); kl_coef 0 or kl None -> only the score.
    A row with no real token gets no reward at all (OpenRLHF would put the score on the last padding slot, which
    its return computation then masks away: same result).
    """
    mask = action_mask.bool()
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0 (got {kl_coef})")
    scores = scores.float()
    if reward_clip_range is not None:
        scores = scores.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if kl is not None and kl_coef > 0:
        rewards = -kl_coef * kl.float() * mask
    else:
        rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    # Last real token: flip the row, the first True of the flipped row is the last True of the original.
    last = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)  # (B, 1)
    score_src = (scores * mask.any(dim=1)).unsqueeze(1)  # (B, 1): rows with no real token add nothing
    return rewards.scatter_add(1, last, score_src)


def group_baseline(scores: torch.Tensor, n_samples: int, estimator: str) -> torch.Tensor:
    """Scores (B,) minus each prompt group's baseline (rows grouped as consecutive blocks of n_samples).

    rloo                r_i - mean of the other n-1 samples of its prompt   (leave-one-out)
    reinforce_baseline  r_i - group mean
    group_norm (GRPO)   (r_i - group mean) / (group std + 1e-9), std unbiased (torch.std, divides by n-1),
                        as OpenRLHF
    dr_grpo             r_i - group mean (Dr. GRPO drops GRPO's / std; same scores as reinforce_baseline,
                        but its advantages are not whitened afterwards: see algo/registry.ESTIMATORS)
    flash_reinforce     r_i - mean of the whole batch (OpenRLHF 0.11.2's FlashREINFORCE: one sample per prompt
                        has no group, so the batch is the baseline; any n works)
    gae, reinforce      unchanged
    """
    if n_samples < 1 or scores.shape[0] % n_samples != 0:
        raise ValueError(
            f"{scores.shape[0]} scores cannot be split into groups of n_samples_per_prompt={n_samples}: "
            "a rollout batch must hold every sample of each prompt, in prompt-major order"
        )
    baseline = estimator_spec(estimator).baseline  # the registry's rule, algo/registry.py
    if baseline is None:
        return scores
    if baseline == "batch_mean":  # flash_reinforce
        return scores.float() - scores.float().mean()
    if n_samples < 2:
        raise ValueError(f"{estimator} compares samples of one prompt: it needs n_samples_per_prompt >= 2")
    groups = scores.float().reshape(-1, n_samples)  # (prompts, n)
    mean = groups.mean(dim=1, keepdim=True)
    if baseline == "leave_one_out":  # rloo
        out = groups - (groups.sum(dim=1, keepdim=True) - groups) / (n_samples - 1)
    elif baseline == "mean_std":  # group_norm
        out = (groups - mean) / (groups.std(dim=1, keepdim=True) + GROUP_NORM_EPS)
    elif baseline == "mean":  # reinforce_baseline, dr_grpo
        out = groups - mean
    else:
        raise ValueError(f"advantage estimator {estimator!r}: unknown group baseline {baseline!r}")
    return out.reshape(-1)


class RunningMoments:
    """Running mean and unbiased std of every value seen so far, for --normalize_reward.

    Batches merge with Chan et al.'s parallel update (exact, not an exponential average):
        delta = mean_b - mean;  n' = n + n_b
        mean' = mean + delta * n_b / n'
        M2'   = M2 + M2_b + delta^2 * n * n_b / n'        (M2 = sum of squared deviations; var = M2 / (n - 1))
    Accumulated in float64 Python floats, so the order of batches does not matter beyond rounding.

    Where this departs from OpenRLHF: OpenRLHF's --normalize_reward divides the reward model's output by a mean/std
    stored in the reward model's config at reward-model training time; orlhf does the same when they are stored
    (the reward worker applies them, inputs/head_files.py) and uses these running statistics only for reward
    sources without stored ones (rule functions, remote URLs, reward models without mean/std), as TRL and
    DeepSpeed-Chat do, where OpenRLHF would leave the rewards as they are. Before two values have been seen, std
    is 1 (nothing to scale by yet).
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0

    def update(self, x: torch.Tensor) -> tuple[float, float]:
        """Fold every element of x into the statistics; returns the running (mean, std) after the update."""
        x = x.detach().double().flatten()
        n_b = x.numel()
        if n_b == 0:
            return self.mean, self.std
        mean_b = x.mean().item()
        m2_b = (x - mean_b).square().sum().item()
        total = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * self.count * n_b / total
        self.count = total
        return self.mean, self.std

    def normalize(self, x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """(x - running mean) / (running std + eps), in x's dtype."""
        return (x - self.mean) / (self.std + eps)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


# --- length shaping of the scores (before the group baseline, as OpenRLHF's experience maker) -----------------


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: float, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, (B,) float32 to add to the scores (0 or negative).

        expected = max_new_tokens - buffer_len
        penalty  = -min(length - expected, buffer_len) / buffer_len * factor   where length > expected, else 0
    So the penalty grows linearly from 0 at `expected` tokens to -factor at max_new_tokens (OpenRLHF's
    apply_overlong_penalty).
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong buffer_len must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    exceed = (lengths.float() - (max_new_tokens - buffer_len)).clamp(max=buffer_len)
    return torch.where(exceed > 0, -exceed / buffer_len * factor, 0.0)


def stop_properly_penalty(scores: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL's penalty for responses cut at the length limit (OpenRLHF's apply_stop_properly_penalty), (B,).

    coef in [0, 1]: a truncated sample's score is multiplied by coef; coef < 0: it is set to coef.
    """
    if coef > 1:
        raise ValueError(f"stop_properly_penalty_coef must be in [0, 1] or negative, got {coef}")
    cut = truncated.bool()
    penalized = torch.full_like(scores.float(), coef) if coef < 0 else scores.float() * coef
    return torch.where(cut, penalized, scores.float())


def keep_groups(scores: torch.Tensor, n_samples: int, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic sampling's test, (prompts,) bool: a prompt's group is kept iff low < mean score < high.

    Open interval, on the group mean (OpenRLHF's dynamic filtering): with 0/1 rewards and range (0, 1) this drops
    the groups that are all right or all wrong, whose group-baselined advantages would be all zero.
    """
    if scores.shape[0] % n_samples:
        raise ValueError(f"{scores.shape[0]} scores are not whole groups of n_samples_per_prompt={n_samples}")
    mean = scores.float().reshape(-1, n_samples).mean(dim=1)
    return (mean > low) & (mean < high)
