"""The model roles of a run, one record each: the single place that says when a role exists and what it is.

    actor    the policy: always; trained, checkpointed, an LM head
    ref      the reference policy: when a KL reads it (TrainConfig.has_reference) and the actor has no LoRA adapter
             (with one, the actor's ranks score it: TrainConfig.reference_from_actor); frozen
    critic   the value model: when the advantage estimator needs one (algo/registry.py); trained, a value head
    reward   the reward model: with --reward_pretrain; frozen, a value head

Read by placement (which pools exist, distributed/layout.py), validation (batch and colocation rules), launch/run.py
(which groups to spawn), config/worker_config.py and launch/plan.py (which model each role loads),
config/fingerprint.py (what a resume must match).
Which role runs inside another's processes is a platform's choice, not a role's fact: on CPU cpu/hosting_rules.py
says (through the seam, distributed/tuning.py Tuning.guests); elsewhere none does.
The vLLM engines are not a model role: distributed/layout.py places them beside the roles (ENGINE).
No torch, no Ray here: validation reads it before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from orlhf.config.train_config import DataConfig, TrainConfig


@dataclass(frozen=True)
class RoleSpec:
    name: str
    trains: bool  # has an optimizer: trains every step, is saved in checkpoints and resumed from them
    value_head: bool  # a scalar head on the last hidden state instead of the LM head
    present: Callable[["TrainConfig"], bool]  # does this run place it?
    model: Callable[["DataConfig"], Optional[str]]  # the model folder it loads (None: the demo not resolved yet)
    colocate_with: Optional[str] = None  # the role whose pool it joins under colocate_flag
    colocate_flag: Optional[str] = None  # PlacementConfig field


# Placement order: the actor's pool first (the engines join it under --colocate_all_models).
ROLES: dict[str, RoleSpec] = {
    "actor": RoleSpec("actor", trains=True, value_head=False, present=lambda cfg: True, model=lambda d: d.pretrain),
    "ref": RoleSpec(
        "ref",
        trains=False,
        value_head=False,
        present=lambda cfg: cfg.has_reference and not cfg.reference_from_actor,
        model=lambda d: d.pretrain,
        colocate_with="actor",
        colocate_flag="colocate_actor_ref",
    ),
    # The critic starts from --critic_pretrain, else the reward model (its head already scores), else the policy.
    "critic": RoleSpec(
        "critic",
        trains=True,
        value_head=True,
        present=lambda cfg: cfg.has_critic,
        model=lambda d: d.critic_pretrain or d.reward_pretrain or d.pretrain,
    ),
    "reward": RoleSpec(
        "reward",
        trains=False,
        value_head=True,
        present=lambda cfg: cfg.has_reward_model,
        model=lambda d: d.reward_pretrain,
        colocate_with="critic",
        colocate_flag="colocate_critic_reward",
    ),
}


def role(name: str) -> RoleSpec:
    spec = ROLES.get(name)
    if spec is None:
        raise ValueError(f"unknown role {name!r}; expected one of {tuple(ROLES)}")
    return spec


def active_roles(cfg: "TrainConfig") -> list[str]:
    """The models this run places, in placement order: the actor always, ref when a KL uses it (not with
    --init_kl_coef 0 and no --use_kl_loss), critic when the estimator needs one, reward with --reward_pretrain."""
    return [name for name, spec in ROLES.items() if spec.present(cfg)]


def trained_roles(cfg: "TrainConfig") -> list[str]:
    """The active roles with an optimizer (train_step each step; saved in checkpoints)."""
    return [name for name in active_roles(cfg) if ROLES[name].trains]


def model_path(cfg: "TrainConfig", name: str) -> Optional[str]:
    """The model folder `name` loads (before resolve.resolve_demo: None for the demo's models)."""
    return role(name).model(cfg.data)
