"""Typed, frozen configuration for `orlhf train-ppo`: one dataclass per flag group.

Every flag is declared once, here (the PPO section in config/ppo_config.py, the engines' and DeepSpeed's in
config/backend_config.py, logging, evaluation and the runtime in config/run_config.py), as a dataclass field whose
metadata carries its command-line name and help (config/option.py); cli.py builds the Typer command from these
fields, so the flag surface, the config tree and `--help` cannot drift apart. Flag names are OpenRLHF's flat names
(`--actor_num_gpus_per_node`), accepted with dashes too.

    flags --cli.py--> dict --flags.parse_config()--> TrainConfig (frozen) --resolve.py: resolve --device auto,
        validate() once (ok | ConfigError(all problems)), the demo's paths--> the config a run starts from

Workers receive only their own slice (config/worker_config.py), never the whole tree. Nothing here imports
torch, ray, deepspeed or vllm: `orlhf --help` must stay fast, and validation runs before Ray starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from orlhf.algo.registry import ESTIMATORS
from orlhf.config.backend_config import DeepSpeedConfig, VLLMConfig
from orlhf.config.option import opt
from orlhf.config.ppo_config import PPOConfig
from orlhf.config.rollout_backends import BackendSpec, backend, backend_name
from orlhf.config.run_config import EvalConfig, LoggingConfig, RuntimeConfig
from orlhf.config.trained_config import LoraConfig, RoleOptimConfig


@dataclass(frozen=True)
class PlacementConfig:
    """Where each model runs. On CPU one "GPU" in these flags means one rank (a CPU bundle)."""

    actor_num_nodes: int = opt(1, "Nodes for the actor (policy) trainer.")
    actor_num_gpus_per_node: int = opt(1, "GPUs per node for the actor trainer (CPU: ranks per node).")
    critic_num_nodes: int = opt(1, "Nodes for the critic (gae only).")
    critic_num_gpus_per_node: int = opt(1, "GPUs per node for the critic.")
    ref_num_nodes: int = opt(1, "Nodes for the reference model.")
    ref_num_gpus_per_node: int = opt(1, "GPUs per node for the reference model.")
    reward_num_nodes: int = opt(1, "Nodes for the reward model (with --reward_pretrain).")
    reward_num_gpus_per_node: int = opt(1, "GPUs per node for the reward model.")
    colocate_actor_ref: bool = opt(False, "Actor and reference share GPUs (needs equal node/GPU counts).")
    colocate_critic_reward: bool = opt(False, "Critic and reward model share GPUs (needs equal node/GPU counts).")
    colocate_all_models: bool = opt(False, "All models and the vLLM engines share the actor's GPUs (hybrid mode).")
    ref_own_process: bool = opt(
        False,
        "CPU only: the reference model in its own rank processes. By default on CPU, when its rank count "
        "equals the actor's, it runs inside the actor's rank processes (one fewer set of processes to start).",
    )
    critic_own_process: bool = opt(
        False,
        "CPU only: the critic in a process of its own. By default on CPU a one-rank critic beside a one-rank actor "
        "runs in the actor's process, on a thread of its own; a critic model with dropout always gets its own.",
    )

    def world_size(self, role: str) -> int:
        return getattr(self, f"{role}_num_nodes") * getattr(self, f"{role}_num_gpus_per_node")


@dataclass(frozen=True)
class DataConfig:
    """Models and data. Without --pretrain orlhf uses its built-in tiny demo (model, prompts, reward)."""

    pretrain: Optional[str] = opt(None, "Actor/reference model: HF folder (default: the built-in tiny demo).")
    reward_pretrain: Optional[str] = opt(None, "Reward model (HF folder; value head on the last token).")
    critic_pretrain: Optional[str] = opt(None, "Critic init (default: --reward_pretrain, else --pretrain).")
    remote_rm_url: Optional[str] = opt(
        None, "Reward source instead of a reward model: http(s)://host:port/path, or a .py file with reward_func."
    )
    agent_func_path: Optional[str] = opt(
        None,
        "Multi-turn agent: a .py file defining AgentInstance and AgentExecutor (OpenRLHF's contract, "
        "orlhf.rollout.agent); the agent's rewards replace a reward source.",
    )
    prompt_data: Optional[str] = opt(
        None,
        "Prompts: .jsonl, .json, .parquet or a saved HF dataset folder; several comma-separated (a,b) are "
        "concatenated, or mixed with --prompt_data_probs.",
    )
    prompt_data_probs: Optional[str] = opt(
        None,
        "Sampling mix of the --prompt_data sources, comma-separated (0.7,0.3): one probability > 0 per "
        "source, summing to 1; sources are drawn until every one has been used whole at least once (as "
        "OpenRLHF's interleave, 'all_exhausted').",
    )
    prompt_split: str = opt("train", "Split of --prompt_data to use (saved DatasetDict folders, hub datasets).")
    value_head_prefix: str = opt(
        "score",
        "Name of the reward model's / critic's value head (its weight is <prefix>.weight); models from "
        "OpenRLHF before 0.5 use value_head. A value_head_prefix in the model's config.json wins, as in OpenRLHF.",
    )
    input_key: str = opt("input", "Prompt field in the data.")
    label_key: Optional[str] = opt(None, "Label field passed to the reward function.")
    apply_chat_template: bool = opt(False, "Wrap prompts with the tokenizer's chat template.")
    input_template: Optional[str] = opt(None, "Template with one {} for the prompt, e.g. 'Q: {}\\nA:'.")
    max_samples: Optional[int] = opt(None, "Use at most this many prompts.")
    image_key: str = opt(
        "images", "Field of a row's images (vision-language models): file paths, or encoded bytes in parquet."
    )
    max_images_per_prompt: int = opt(
        0, "Images a prompt may have; > 0 trains a vision-language model on image prompts (0: text only)."
    )
    freeze_visual_encoder: bool = opt(
        False, "Vision-language models: train the language model only (the vision tower and projector frozen)."
    )
    prompt_overflow: str = opt(
        "skip",
        "Prompts longer than --prompt_max_len: skip them or truncate (keep the end).",
        choices=("skip", "truncate"),
    )
    reward_timeout_s: float = opt(
        300.0,
        "Longest wait for one batch's rewards from --remote_rm_url before the run stops: one call of a .py file's "
        "reward_func, or an HTTP request with all its retries.",
    )
    reward_retries: int = opt(
        5,
        "Retries of an HTTP reward request that fails to connect, times out or gets a 5xx answer, with backoff "
        "(1, 2, 4... s) within --reward_timeout_s; 0: no retry.",
    )
    dataloader_num_workers: int = opt(
        0,
        "Accepted for OpenRLHF's scripts; no effect: orlhf reads the prompts into memory once, with no data-loader "
        "worker processes.",
    )

    @property
    def uses_demo(self) -> bool:
        return self.pretrain is None


# The sections, in --help order: (attribute on TrainConfig, class, help panel).
SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("placement", PlacementConfig, "Placement"),
    ("vllm", VLLMConfig, "vLLM engines"),
    ("deepspeed", DeepSpeedConfig, "DeepSpeed"),
    ("lora", LoraConfig, "LoRA"),
    ("data", DataConfig, "Models and data"),
    ("ppo", PPOConfig, "PPO"),
    ("optim", RoleOptimConfig, "Per-role optimizers"),
    ("logging", LoggingConfig, "Logging and checkpoints"),
    ("eval", EvalConfig, "Evaluation"),
    ("runtime", RuntimeConfig, "Runtime"),
)


@dataclass(frozen=True)
class TrainConfig:
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    optim: RoleOptimConfig = field(default_factory=RoleOptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # Where each flag's value came from ((flag, source) pairs), recorded once when the command line is read
    # (config/provenance.py with_sources). A record, not a setting: a declared field left out of equality
    # (compare=False) and of settings_of() (what fingerprints and the config sent to W&B read).
    recorded_sources: tuple[tuple[str, str], ...] = field(
        default=(), compare=False, repr=False, metadata={"record": True}
    )

    @property
    def sources(self) -> dict[str, str]:
        """{flag name: source} (provenance.py's vocabulary); empty for a config built in code, not from flags."""
        return dict(self.recorded_sources)

    @property
    def device(self) -> str:
        """The device the run uses, "cuda" or "cpu": --device with "auto" resolved (config/resolve.py). The one place
        everything that places or builds a model reads it from; asking before it is resolved is a bug."""
        if self.runtime.device not in ("cuda", "cpu"):
            raise ValueError(
                f"device {self.runtime.device!r} is not resolved yet; finish the config first "
                "(resolve.finish_config, or resolve.resolve_device)"
            )
        return self.runtime.device

    @property
    def has_critic(self) -> bool:
        """The critic rule, written once: a critic runs when the advantage estimator needs values
        (algo/registry.py: gae)."""
        spec = ESTIMATORS.get(self.ppo.advantage_estimator)
        return spec is not None and spec.needs_critic

    @property
    def has_reward_model(self) -> bool:
        return self.data.reward_pretrain is not None

    @property
    def has_reference(self) -> bool:
        """A reference model runs only when a KL reads it (OpenRLHF: --init_kl_coef 0 means no reference model).
        Without one the KL term is 0 * KL in the rewards; its forward could not change a single update."""
        return self.ppo.init_kl_coef > 0 or self.ppo.use_kl_loss

    @property
    def rollout_name(self) -> str:
        """The run's rollout backend (config/rollout_backends.py): --rollout_backend, with --vllm_num_engines 0 read
        as the trainer backend there, once."""
        return backend_name(self.vllm.rollout_backend, self.vllm.num_engines)

    @property
    def rollout(self) -> BackendSpec:
        """The run's rollout backend's record: whether it places engines and under which name, where its generation
        memory lives, its class. What every module outside config/ reads to tell backends apart."""
        return backend(self.rollout_name)

    @property
    def engines_colocated(self) -> bool:
        """The rollout engines share the actor's devices: --colocate_all_models, except with --async_train, where they
        keep devices of their own so generation overlaps training and only the DeepSpeed models share (OpenRLHF's
        async mode does the same). False when the backend places no engines."""
        return self.placement.colocate_all_models and not self.ppo.async_train and self.rollout.places_engines

    @property
    def num_engines(self) -> int:
        """Rollout engines the run places and starts (none when its backend places none)."""
        return self.vllm.num_engines if self.rollout.places_engines else 0

    @property
    def reference_from_actor(self) -> bool:
        """With LoRA the reference log-probs come from the actor's ranks (its base weights, adapter off) instead of a
        reference group: the same weights, without a second copy of the model."""
        return self.has_reference and self.lora.enabled

    @property
    def single_pass(self) -> bool:
        """Each step's experience meets exactly one optimizer step (--max_epochs 1 and rollout_batch_size x
        n_samples_per_prompt == train_batch_size), no KL is shaped into the rewards and no adaptive KL controller
        reads KL(old || ref). Then the old policy IS the current one: the PPO ratio is exactly 1, and the actor
        uses its own detached log-probs from the training forward instead of a separate old-log-prob forward (the
        same update; TRL's GRPO does the same)."""
        p = self.ppo
        one_step = p.rollout_batch_size * p.n_samples_per_prompt == p.train_batch_size
        kl_in_reward = p.init_kl_coef > 0 and not p.use_kl_loss  # shaped from the old log-probs
        adaptive = p.kl_target is not None and self.has_reference  # steered by KL(old || ref) each step
        return p.max_epochs == 1 and one_step and not kl_in_reward and not adaptive


def settings_of(cfg: TrainConfig) -> dict[str, Any]:
    """dataclasses.asdict(cfg) without the records (fields whose metadata says "record"): the settings alone."""
    records = {f.name for f in dataclasses.fields(cfg) if f.metadata.get("record")}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in records}


class ConfigError(ValueError):
    """Invalid flags. `problems` lists each one with the flags it names and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(f"  - {p}" for p in self.problems))


# vLLM's share of an engine GPU when --vllm_gpu_memory_utilization is not given. Colocated, the trainers' CUDA
# contexts, NCCL buffers and (without --deepspeed_enable_sleep) states stay on the same GPU while the engine
# generates, so it gets half, as OpenRLHF's hybrid-engine examples.
GPU_MEMORY_UTILIZATION_OWN = 0.9
GPU_MEMORY_UTILIZATION_COLOCATED = 0.5


def engine_gpu_memory_utilization(cfg: "TrainConfig") -> float:
    """--vllm_gpu_memory_utilization as given, else the default for the placement (never a rewrite)."""
    if cfg.vllm.gpu_memory_utilization is not None:
        return cfg.vllm.gpu_memory_utilization
    if cfg.engines_colocated:
        return GPU_MEMORY_UTILIZATION_COLOCATED
    return GPU_MEMORY_UTILIZATION_OWN
