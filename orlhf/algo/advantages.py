"""Advantages and returns from per-token rewards (OpenRLHF's experience maker, as pure functions).

    gae                  A_t = sum_k (gamma * lambd)^k delta_{t+k},  delta_t = r_t + gamma * V_{t+1} - V_t
                         returns (critic targets) = A + V
    discounted_returns   G_t = sum_k gamma^k r_{t+k}                 (REINFORCE++ and the group estimators)
    whiten               (x - mean) / std over the real tokens of the whole batch

Rewards come from rewards.shape_rewards; for the group estimators the group baseline was already applied to the
scores (see compute_advantages). Padding is right padding: every position after a row's last real token.
"""

from __future__ import annotations

from typing import Optional

import torch

from orlhf.algo.registry import estimator as estimator_spec

WHITEN_VAR_EPS = 1e-8


def gae(
    rewards: torch.Tensor,  # (B, A) per-token rewards
    values: torch.Tensor,  # (B, A) V(s_t) from the critic at experience time
    action_mask: torch.Tensor,  # (B, A) bool, right-padded
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2015), OpenRLHF's get_advantages_and_returns.

    Rewards and values are zeroed on padding first, so V after the last real token is 0 (the episode ends there)
    and padding gets advantage 0. Returns (advantages, returns), both (B, A) float32, returns = advantages + values.
    """
    mask = action_mask.bool()
    rewards = torch.where(mask, rewards.float(), 0.0)
    values = torch.where(mask, values.float(), 0.0)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,) the GAE sum from t+1 on
    next_values = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        running = delta + gamma * lambd * running
        advantages[:, t] = running
        next_values = values[:, t]
    return advantages, advantages + values


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, (B, A) float32, padding rewards zeroed (OpenRLHF's get_cumulative_returns)."""
    rewards = torch.where(action_mask.bool(), rewards.float(), 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, divide_std: bool = True) -> torch.Tensor:
    """Whiten x with the mean and std of its masked entries only (one global mean/std); padding comes out 0.

    x' = (x - mean) * rsqrt(max(var, 1e-8)), var the biased (divide-by-N) variance over the masked entries:
    exactly OpenRLHF's advantage normalization. (The common `/ (std + 1e-8)` form differs only when std < ~1e-4.)
    shift_mean=False scales around the mean without removing it (x' + mean), as TRL's whiten.
    divide_std=False only centres: x' = x - mean (OpenRLHF's --no_advantage_std_norm).
    Where this departs from OpenRLHF: padding is set to 0 (OpenRLHF leaves -mean/std there; the losses mask it).
    """
    m = mask.bool()
    x = torch.where(m, x.float(), 0.0)
    n = m.sum()
    if n == 0:
        return x
    mean = x.sum() / n
    var = torch.where(m, (x - mean).square(), 0.0).sum() / n
    out = (x - mean) * var.clamp(min=WHITEN_VAR_EPS).rsqrt() if divide_std else x - mean
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,  # (B, A) from rewards.shape_rewards
    action_mask: torch.Tensor,  # (B, A) bool
    values: Optional[torch.Tensor] = None,  # (B, A) critic values, gae only
    gamma: float = 1.0,
    lambd: float = 1.0,
    std_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, A) float32 and 0 on padding, for one whole rollout batch.

    std_norm=False (--no_advantage_std_norm): the whitened estimators only subtract the batch mean.

    The controller's order (OpenRLHF's): scores -> rewards.group_baseline -> rewards.shape_rewards(kl) -> here.
    The group baseline acts on the *scores*, before the KL penalty is added, so the KL part of the reward is never
    centred across samples.

        gae                 advantages = whiten(GAE(rewards, values)); returns = GAE + values (the critic targets,
                            not whitened)
        reinforce, rloo, reinforce_baseline, group_norm, dr_grpo, flash_reinforce
                            returns = discounted_returns(rewards, gamma); advantages = returns, whitened for
                            reinforce and reinforce_baseline only (algo/registry.ESTIMATORS[...].whiten, as
                            OpenRLHF). The returns feed no critic; they are given back for logging.
    Whitening uses the statistics of this batch: call it once on the whole rollout batch, not per micro-batch, as
    OpenRLHF normalizes across all experiences of a step.

    Multi-turn rollouts (feedback tokens inside the response, action_mask 0 there): the recurrences run over the
    model's own tokens only, as if the feedback took no time step; rows are compacted (actions first, in order),
    computed as above and put back, so feedback positions get advantage 0 and GAE bootstraps from the value of
    the next model token, not from a feedback position (OpenRLHF runs through the gap with zeroed values, which
    is the same only for gamma = lambd = 1).

    Where this departs from OpenRLHF: a group estimator with gamma != 1 raises, where OpenRLHF warns and rewrites
    args.gamma to 1 (its group baseline assumes one undiscounted reward per sample).
    """
    spec = estimator_spec(estimator)
    order = actions_first(action_mask)
    if not bool((order == torch.arange(order.shape[1])).all()):  # multi-turn: feedback tokens between actions
        compact = lambda x: None if x is None else x.gather(1, order)  # noqa: E731
        adv, ret = compute_advantages(
            estimator, compact(rewards), compact(action_mask), compact(values), gamma, lambd, std_norm
        )
        return _scatter_rows(adv, order), _scatter_rows(ret, order)
    if spec.needs_critic:
        if values is None:
            raise ValueError(f"advantage estimator {estimator!r} needs critic values")
        advantages, returns = gae(rewards, values, action_mask, gamma, lambd)
    else:
        if spec.whole_response and gamma != 1.0:
            raise ValueError(
                f"advantage estimator {estimator!r} needs --gamma 1.0 (got {gamma}): its baseline "
                "is on whole-response scores; use reinforce for a discounted return"
            )
        returns = discounted_returns(rewards, action_mask, gamma)
        advantages = returns
    if spec.whiten:
        advantages = whiten(advantages, action_mask, divide_std=std_norm)
    else:
        advantages = advantages.clone()  # callers may edit advantages in place without touching returns
    return advantages, returns


def actions_first(action_mask: torch.Tensor) -> torch.Tensor:
    """(B, A) long: per row, the action positions in order, then the others (identity for right padding)."""
    return torch.sort((~action_mask.bool()).to(torch.int8), dim=1, stable=True).indices


def _scatter_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Undo x.gather(1, order) (order is a permutation of each row)."""
    return torch.empty_like(x).scatter_(1, order, x)
