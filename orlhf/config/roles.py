"""The model roles of a run, one record each: the single place that says when a role exists and what it is.

    actor    the policy: always; trained, checkpointed, an LM head
    ref      the reference policy: when a KL reads it (TrainConfig.has_reference) and the actor has no LoRA adapter
             (with one, the actor's ranks score it: TrainConfig.reference_from_actor); frozen
    critic   the value model: when the advantage estimator needs one (algo/registry.py); trained, a value head
    reward   the reward model: with --reward_pretrain; frozen, a value head

Read by placement (which pools exist, distributed/layout.py), validation (batch and colocation rules), launch/run.py
(which groups
to spawn), config/worker_config.py and launch/plan.py (which model each role loads), config/fingerprint.py (what a
resume must match).
host_of says which role runs inside another's processes (on CPU the reference in the actor's ranks, and a one-rank
critic in a one-rank actor's process); runs_beside, which of those run their calls beside the host's.
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


def host_of(cfg: "TrainConfig", name: str) -> Optional[str]:
    """The role in whose rank processes `name` runs, or None for its own processes. CPU only: GPUs keep separate
    processes (each rank owns its device). A process of its own costs a Ray worker plus torch, transformers and
    DeepSpeed imports and their memory, before the first step (benchmarks/results/2026-11-23-trl-compare-startup.md).

    - ref: inside the actor's rank processes (rank k's reference worker in actor rank k's process) when both have
      the same rank count: a frozen forward. --ref_own_process keeps it apart.
    - critic: inside the actor's process when both have one rank, its calls on a thread beside the actor's
      (runs_beside): two one-thread train steps side by side in one process take as long as in two processes,
      and far less than one after the other (benchmarks/results/2026-11-25-trl-compare-hosted-critic.md). Not
      when its model or its LoRA adapter has dropout (concurrent steps would interleave their draws from the
      process's one random generator: a seeded run would not reproduce), nor with LoRA under --zero_stage 3 (two
      adapted ZeRO-3 engines stepping on two threads of one process failed in DeepSpeed's parameter fetch, an
      adapter parameter still in flight), nor with --colocate_critic_reward.
      --critic_own_process keeps it apart."""
    if cfg.device != "cpu" or not role(name).present(cfg):
        return None
    p = cfg.placement
    if name == "ref" and not p.ref_own_process:
        same = (p.ref_num_nodes, p.ref_num_gpus_per_node) == (p.actor_num_nodes, p.actor_num_gpus_per_node)
        return "actor" if same else None
    if name == "critic" and not (p.critic_own_process or p.colocate_critic_reward):
        one_rank = p.world_size("actor") == 1 and p.world_size("critic") == 1
        dropout = has_dropout(model_path(cfg, "critic")) or (cfg.lora.enabled and cfg.lora.lora_dropout > 0)
        lora_zero3 = cfg.lora.enabled and cfg.deepspeed.zero_stage == 3
        return "actor" if one_rank and not dropout and not lora_zero3 else None
    return None


def runs_beside(cfg: "TrainConfig", name: str) -> bool:
    """A trained guest: its work calls (train steps, values) run on a thread beside its host's calls instead of
    after them, in turn, or the two train steps would run one after the other (host_of hosts one only where that
    is safe: the critic, one rank, no dropout). The processes' thread shares count it as a process of its own
    (cpu/threads.py). A frozen guest (the reference) takes its turn."""
    return role(name).trains and host_of(cfg, name) is not None


def has_dropout(folder: Optional[str]) -> bool:
    """Does config.json of the model in `folder` set any dropout probability above 0 (Llama's attention_dropout,
    GPT-2's resid_pdrop, BERT's hidden_dropout_prob, ...)? None, the built-in demo before its path is resolved:
    no (its attention_dropout is 0). A folder without a readable config.json (e.g. a hub id): counted as yes."""
    if folder is None:
        return False
    from orlhf.inputs.head_files import read_config

    config = read_config(folder)
    return not config or _sets_dropout(config)


def _sets_dropout(config: dict) -> bool:
    """Any dropout probability above 0 in `config` or a config nested in it (a text_config, ...)."""
    for k, v in config.items():
        if isinstance(v, dict) and _sets_dropout(v):
            return True
        if (
            ("dropout" in k.lower() or k.lower().endswith("pdrop"))
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and v > 0
        ):
            return True
    return False


def guest_roles(cfg: "TrainConfig") -> dict[str, str]:
    """{role: its host role} for the active roles that run inside another's processes (host_of)."""
    return {name: host for name in active_roles(cfg) if (host := host_of(cfg, name)) is not None}
