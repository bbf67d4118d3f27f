"""CPU runs' hosting rules: which role runs inside another role's rank processes, and which of those run their calls
beside the host's. A process of its own costs a Ray worker plus torch, transformers and DeepSpeed imports and their
memory before the first step; on GPUs every rank owns its device, so nothing is hosted there (the seam's default,
distributed/tuning.py Tuning.guests; this module is CpuTuning.guests). The placement reads the answer
(distributed/layout.py: a guest joins its host's pool and asks for no share), cpu/hosting.py starts it, and
cpu/threads.py counts a guest whose calls run beside its host's as a process of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from orlhf.config.roles import active_roles, model_path, role
from orlhf.inputs.head_files import read_config

if TYPE_CHECKING:
    from orlhf.config.train_config import TrainConfig


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
