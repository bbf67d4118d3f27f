"""The flag sections of how the trained models (actor, critic) learn beyond PPO's shared flags: each role's own
optimizer settings (OpenRLHF 0.11's --actor.* / --critic.* names) and LoRA. Declared as config/train_config.py's
sections are (config/option.py); TrainConfig holds them as `optim` and `lora`. No torch here either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orlhf.config.option import opt
from orlhf.config.ppo_config import LR_SCHEDULERS

OPTIMS = ("adam", "muon")


@dataclass(frozen=True)
class RoleOptimConfig:
    """Each trained role's own optimizer settings (OpenRLHF 0.11's --actor.* / --critic.* names). Unset, a role takes
    the shared flag (--max_norm, --adam_betas, --l2, --lr_scheduler, --lr_warmup_ratio), so v0.10.1's flat flags
    keep their meaning; set, it applies to that role only."""

    actor_max_norm: Optional[float] = opt(None, "The actor's gradient clipping (default: --max_norm).")
    critic_max_norm: Optional[float] = opt(None, "The critic's gradient clipping (default: --max_norm).")
    actor_adam_betas: Optional[tuple[float, float]] = opt(
        None, "The actor's Adam betas (default: --adam_betas).", metavar="BETA1 BETA2"
    )
    critic_adam_betas: Optional[tuple[float, float]] = opt(
        None, "The critic's Adam betas (default: --adam_betas).", metavar="BETA1 BETA2"
    )
    actor_adam_eps: float = opt(1e-8, "The actor's Adam epsilon.")
    critic_adam_eps: float = opt(1e-8, "The critic's Adam epsilon.")
    actor_weight_decay: Optional[float] = opt(None, "The actor's AdamW weight decay (default: --l2).")
    critic_weight_decay: Optional[float] = opt(None, "The critic's AdamW weight decay (default: --l2).")
    actor_lr_scheduler: Optional[str] = opt(
        None, "The actor's LR schedule (default: --lr_scheduler).", choices=LR_SCHEDULERS, metavar="NAME"
    )
    critic_lr_scheduler: Optional[str] = opt(
        None, "The critic's LR schedule (default: --lr_scheduler).", choices=LR_SCHEDULERS, metavar="NAME"
    )
    actor_lr_warmup_ratio: Optional[float] = opt(None, "The actor's LR warm-up share (default: --lr_warmup_ratio).")
    critic_lr_warmup_ratio: Optional[float] = opt(None, "The critic's LR warm-up share (default: --lr_warmup_ratio).")
    actor_min_lr_ratio: float = opt(0.1, "The actor's floor of cosine_with_min_lr, as a share of its peak LR.")
    critic_min_lr_ratio: float = opt(0.1, "The critic's floor of cosine_with_min_lr, as a share of its peak LR.")
    actor_optim: str = opt(
        "adam",
        "The actor's optimizer: adam (AdamW), or muon (DeepSpeed's Muon on the 2-D weights, AdamW with the actor's "
        "learning rate and Adam settings on the rest).",
        choices=OPTIMS,
    )
    critic_optim: str = opt("adam", "The critic's optimizer (as --actor_optim).", choices=OPTIMS)
    actor_muon_lr: float = opt(0.02, "With --actor_optim muon: the Muon weights' learning rate.")
    critic_muon_lr: float = opt(0.02, "With --critic_optim muon: the Muon weights' learning rate.")
    actor_muon_momentum: float = opt(0.95, "With --actor_optim muon: Muon's momentum.")
    critic_muon_momentum: float = opt(0.95, "With --critic_optim muon: Muon's momentum.")

    def of(self, role: str, ppo) -> dict:
        """`role`'s settings with the shared flags (`ppo`: PPOConfig) filling what is unset."""

        def pick(name: str, shared):
            own = getattr(self, f"{role}_{name}")
            return shared if own is None else own

        return dict(
            max_norm=pick("max_norm", ppo.max_norm),
            adam_betas=tuple(pick("adam_betas", ppo.adam_betas)),
            adam_eps=getattr(self, f"{role}_adam_eps"),
            weight_decay=pick("weight_decay", ppo.l2),
            lr_scheduler=pick("lr_scheduler", ppo.lr_scheduler),
            lr_warmup_ratio=pick("lr_warmup_ratio", ppo.lr_warmup_ratio),
            min_lr_ratio=getattr(self, f"{role}_min_lr_ratio"),
            optim=getattr(self, f"{role}_optim"),
            muon_lr=getattr(self, f"{role}_muon_lr"),
            muon_momentum=getattr(self, f"{role}_muon_momentum"),
        )


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (peft) on the actor and the critic instead of full fine-tuning (OpenRLHF's flags and defaults). With an
    adapter the reference is the actor's own base weights with the adapter off (no reference group), and the
    engines get the adapted modules' merged weights after every update (workers/lora.py)."""

    lora_rank: int = opt(0, "LoRA rank of the actor and the critic (0: full fine-tuning).")
    lora_alpha: int = opt(16, "LoRA alpha: the adapter's update is scaled by alpha / rank.")
    target_modules: str = opt(
        "all-linear",
        "Modules that get an adapter: all-linear (every Linear layer but the output head), or names, "
        "space- or comma-separated (q_proj v_proj).",
        metavar="NAMES",
    )
    lora_dropout: float = opt(0.0, "Dropout on the adapter's input while training.")
    load_in_4bit: bool = opt(
        False, "QLoRA: the frozen base weights in 4-bit NF4 (bitsandbytes; CUDA and --bf16 only; needs --lora_rank)."
    )
    lora_save_merged: bool = opt(
        False,
        "Also export the final actor with the adapter merged into its weights, a plain HF folder "
        "(<save_path>/actor_merged), beside the adapter in <save_path>/actor.",
    )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def targets(self) -> "str | tuple[str, ...]":
        """peft's target_modules: the string "all-linear", or a tuple of module names."""
        names = tuple(n for n in self.target_modules.replace(",", " ").split() if n)
        return "all-linear" if names == ("all-linear",) else names
