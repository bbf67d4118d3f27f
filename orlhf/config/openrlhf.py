"""OpenRLHF's `train_ppo_ray` flags on orlhf's command line: the one table of how each reaches orlhf.

    argv --translate()--> argv in orlhf's own flag names (config/train_config.py), or CompatError listing every problem

OPENRLHF_V0101_FLAGS lists all 144 flags of OpenRLHF v0.10.1's train_ppo_ray (openrlhf/cli/train_ppo_ray.py at
tag v0.10.1, in its order). Each one is, in orlhf, one of:
  - a config field of the same name (config/train_config.py): parsed as is;
  - an ALIAS: another spelling of an orlhf flag, its value translated (`--param_dtype bf16` is `--bf16`);
  - NO_EFFECT: a flag that changes nothing in OpenRLHF v0.10.1 either (accepted, documented why);
  - UNSUPPORTED: a feature orlhf does not have yet. Accepted only with OpenRLHF's default value, which asks for
    nothing (`--ring_attn_size 1`); any other value is refused by name with exit 2.
OpenRLHF's newer dotted names (`--actor.model_name_or_path`, `--algo.advantage.estimator`) are rewritten to these
flat names first (config/openrlhf_dotted.py), so each option has one meaning whatever its spelling. A flag given
twice under different spellings (`--max_new_tokens 64 --generate_max_len 32`) with different values is an error,
never a silent pick. Nothing here imports torch/ray: it runs before Typer parses the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from orlhf.config.openrlhf_dotted import DOTTED

OPENRLHF_V0101_FLAGS: tuple[str, ...] = tuple(
    """
ref_num_nodes ref_num_gpus_per_node reward_num_nodes reward_num_gpus_per_node colocate_actor_ref actor_num_nodes
actor_num_gpus_per_node critic_num_nodes critic_num_gpus_per_node colocate_critic_reward colocate_all_models
vllm_num_engines vllm_tensor_parallel_size vllm_sync_backend vllm_sync_with_ray enable_prefix_caching enforce_eager
vllm_enable_sleep vllm_gpu_memory_utilization enable_vllm_is_correction vllm_is_truncated_threshold
vllm_is_correction_type async_train async_queue_size partial_rollout eval_steps save_steps logging_steps ckpt_path
save_hf_ckpt disable_ds_ckpt max_ckpt_num max_ckpt_mem load_checkpoint best_metric_key use_ds_universal_ckpt
local_rank zero_stage gradient_checkpointing deepcompile param_dtype enable_ema ema_beta zpg adam_offload
actor_init_on_gpu attn_implementation use_liger_kernel grad_accum_dtype overlap_comm
gradient_checkpointing_use_reentrant disable_fast_tokenizer dataloader_num_workers deepspeed_enable_sleep
ds_tensor_parallel_size packing_samples use_dynamic_batch rollout_max_tokens_per_gpu train_max_tokens_per_gpu
load_in_4bit lora_rank lora_alpha target_modules lora_dropout save_path num_episodes rollout_batch_size
vllm_generate_batch_size micro_rollout_batch_size max_epochs max_len max_new_tokens max_samples max_norm l2
ptx_coef eps_clip eps_clip_low_high dual_clip value_clip lambd gamma micro_train_batch_size train_batch_size
normalize_reward top_p temperature seed full_determinism freezing_actor_steps n_samples_per_prompt
save_value_network actor_learning_rate critic_learning_rate lr_warmup_ratio lr_scheduler kl_target kl_horizon
init_kl_coef policy_loss_type kl_estimator aux_loss_coef entropy_loss_coef adam_betas reward_clip_range
advantage_estimator use_kl_loss no_advantage_std_norm overlong_buffer_len overlong_penalty_factor
stop_properly_penalty_coef ring_attn_size ring_head_stride pretrain reward_pretrain remote_rm_url critic_pretrain
value_head_prefix ref_reward_offload agent_func_path prompt_data prompt_data_probs prompt_split eval_dataset
eval_split eval_temperature eval_n_samples_per_prompt input_key label_key input_template apply_chat_template
use_wandb wandb_org wandb_group wandb_project wandb_run_name dynamic_filtering dynamic_filtering_reward_range
image_key max_images_per_prompt freeze_visual_encoder use_tensorboard perf use_ms
""".split()
)

STAR = -1  # nargs="*": every value up to the next flag


@dataclass(frozen=True)
class Alias:
    """`--name VALUE...` means `--target` with `convert(values)`: a list of tokens (the target flag and its value,
    [] for "the target off"), or a str: why this value is refused."""

    target: str
    nargs: int
    convert: Callable[[list[str]], "list[str] | str"]
    target_value: Callable[[list[str]], Optional[str]] = lambda v: v[0] if v else "true"  # for conflict checks


@dataclass(frozen=True)
class Unsupported:
    """A feature orlhf lacks: accepted only as `default` (OpenRLHF's value, which turns it off)."""

    nargs: int  # 0: a store_true flag (any use asks for the feature)
    default: Optional[tuple[str, ...]]
    what: str  # the feature, for the message


@dataclass(frozen=True)
class NoEffect:
    nargs: int
    why: str


def _param_dtype(v: list[str]) -> list[str] | str:
    if v[0] == "bf16":
        return ["--bf16"]
    return f"--param_dtype {v[0]}: orlhf trains in fp32 (default) or bf16 (--param_dtype bf16 / --bf16)"


def _attn(v: list[str]) -> list[str] | str:
    if v[0] == "flash_attention_2":
        return ["--flash_attn"]
    if v[0] == "sdpa":
        return []  # orlhf's default attention (eager where a model has no SDPA)
    if v[0] == "eager":
        return ["--eager_attention"]
    return f"--attn_implementation {v[0]}: orlhf runs flash_attention_2 (--flash_attn), sdpa (the default) or eager"


ALIASES: dict[str, Alias] = {
    "param_dtype": Alias("bf16", 1, _param_dtype, lambda v: "true" if v[0] == "bf16" else None),
    "attn_implementation": Alias(
        "flash_attn", 1, _attn, lambda v: {"flash_attention_2": "true", "sdpa": "false"}.get(v[0])
    ),
    "max_new_tokens": Alias("generate_max_len", 1, lambda v: ["--generate_max_len", v[0]]),
    # OpenRLHF v0.10.1's own examples/scripts/train_dapo_ray_hybrid_engine.sh spells --enable_vllm_is_correction so
    # (its argparse refuses it); the flag it means, taken instead of failing the script
    "vllm_enable_is_correction": Alias("enable_vllm_is_correction", 0, lambda v: ["--enable_vllm_is_correction"]),
}

NO_EFFECT: dict[str, NoEffect] = {
    "ptx_coef": NoEffect(1, "OpenRLHF v0.10.1 has no pretraining-data loss either, so the coefficient is unused"),
    "perf": NoEffect(0, "orlhf always records timing/<phase> per step and prints the split at the end"),
    "disable_fast_tokenizer": NoEffect(
        0,
        "OpenRLHF v0.10.1 passes use_fast=False to AutoTokenizer, which transformers 5 (its pinned 5.5.3, and "
        "orlhf's) ignores: the same tokenizer loads either way",
    ),
}


def _u(nargs: int, default: Optional[tuple[str, ...]], what: str) -> Unsupported:
    return Unsupported(nargs, default, what)


UNSUPPORTED: dict[str, Unsupported] = {
    "local_rank": _u(1, ("-1",), "the deepspeed launcher (orlhf places ranks with Ray)"),
    "deepcompile": _u(0, None, "DeepSpeed deepcompile"),
    "actor_init_on_gpu": _u(0, None, "initialising the actor on the GPU"),
    "ds_tensor_parallel_size": _u(1, ("1",), "DeepSpeed tensor parallelism"),
    "ring_attn_size": _u(1, ("1",), "ring attention"),
    "ring_head_stride": _u(1, ("1",), "ring attention"),
    "use_ms": _u(0, None, "ModelScope downloads"),
}


# OpenRLHF v0.11's dotted names with no flat v0.10.1 spelling and no orlhf flag: what each does here.
# DeepSpeed 0.19.8's Muon runs 5 Newton-Schulz steps with Nesterov momentum, fixed (OpenRLHF's placeholders too).
_FIXED = "other Muon Newton-Schulz settings (DeepSpeed 0.19.8's Muon fixes 5 steps with Nesterov momentum)"
DOTTED_ONLY: dict[str, "Unsupported | NoEffect"] = {
    **{f"{role}.muon.ns_steps": Unsupported(1, ("5",), _FIXED) for role in ("actor", "critic")},
    **{
        f"{role}.muon.nesterov": NoEffect(0, "Nesterov momentum is what Muon runs anyway")
        for role in ("actor", "critic")
    },
    **{f"{role}.muon.no_nesterov": Unsupported(0, None, _FIXED) for role in ("actor", "critic")},
}


class CompatError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


def _flat(name: str) -> tuple[str, bool]:
    """(flat name, whether it was a dotted name) for a flag name without its leading dashes."""
    key = name.replace("-", "_")
    if "." in key:
        if key not in DOTTED:
            return key, True
        return DOTTED[key], True
    return key, False


def _take(argv: list[str], i: int, inline: Optional[str], nargs: int) -> tuple[list[str], int]:
    """The values of the flag at argv[i] and the index after them."""
    if inline is not None:
        return [inline], i + 1
    j = i + 1
    if nargs == STAR:
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
    else:
        j = min(len(argv), i + 1 + nargs)
    return argv[i + 1 : j], j


def translate(argv: list[str], native_arity: dict[str, int]) -> list[str]:
    """Rewrite OpenRLHF spellings into orlhf flags (see the module docstring). `native_arity`: orlhf's own flags
    and how many values each takes (0 for switches). Tokens that are not flags pass through untouched, and so do
    flags this table does not know (Typer reports those)."""
    return translate_spelled(argv, native_arity)[0]


def translate_spelled(argv: list[str], native_arity: dict[str, int]) -> tuple[list[str], dict[str, str]]:
    """translate(), and for each orlhf flag set through another spelling, the spelling the user wrote
    ({"critic_max_norm": "--critic.max_norm", "bf16": "--param_dtype bf16"}): config/provenance.py names it."""
    reader = _Reader(argv, native_arity)
    i = 0
    while i < len(argv):
        i = reader.read(i)
    problems = reader.problems + _conflicts(reader.seen)
    if problems:
        raise CompatError(problems)
    return reader.out, reader.spellings


class _Reader:
    """One pass over argv: each flag is rewritten by its kind (dotted-only, alias, no effect, unsupported, orlhf's
    own), collecting the problems, the values each orlhf flag was given under which spelling, and the spellings."""

    def __init__(self, argv: list[str], native_arity: dict[str, int]):
        self.argv, self.arity = argv, native_arity
        self.out: list[str] = []
        self.problems: list[str] = []
        self.seen: dict[str, list[tuple[str, Optional[str]]]] = {}  # orlhf flag -> [(spelling used, value)]
        self.spellings: dict[str, str] = {}  # orlhf flag -> the OpenRLHF spelling that set it last

    def read(self, i: int) -> int:
        """Rewrite the token at argv[i] (and its values); the index of the next one."""
        tok = self.argv[i]
        if not tok.startswith("--") or tok == "--":
            self.out.append(tok)
            return i + 1
        name, _, inline = tok[2:].partition("=")
        inline = inline if "=" in tok else None
        flat, dotted = _flat(name)
        if dotted and flat in DOTTED_ONLY:
            return self._refused_unless_default(i, name, inline, DOTTED_ONLY[flat], None)
        if dotted and "." in flat:
            self.problems.append(f"--{name} is one of OpenRLHF's newer names; orlhf has no equivalent of it yet")
            return i + 1
        if flat in ALIASES:
            return self._alias(i, name, inline, ALIASES[flat])
        if flat in NO_EFFECT or flat in UNSUPPORTED:
            return self._refused_unless_default(i, name, inline, NO_EFFECT.get(flat) or UNSUPPORTED[flat], flat)
        if flat not in self.arity:  # unknown here: Typer names it
            self.out.append(tok)
            return i + 1
        return self._native(i, tok, name, inline, flat, dotted)

    def _refused_unless_default(self, i, name, inline, spec: "Unsupported | NoEffect", flat: Optional[str]) -> int:
        """A flag with no orlhf flag behind it: dropped, or refused when it asks for a feature orlhf lacks."""
        values, i = _take(self.argv, i, inline, spec.nargs)
        if not isinstance(spec, Unsupported):
            return i
        if (flat is not None and spec.nargs == 0) or spec.default is None or not _same(values, spec.default):
            shown = f"--{name}" + "".join(f" {v}" for v in values)
            why = f"--{flat} is OpenRLHF's; orlhf does not support it yet" if flat else "orlhf does not support it yet"
            self.problems.append(f"{shown}: {why} ({spec.what})")
        return i

    def _alias(self, i: int, name: str, inline: Optional[str], spec: Alias) -> int:
        values, i = _take(self.argv, i, inline, spec.nargs)
        got = spec.convert(values)
        if isinstance(got, str):
            self.problems.append(got)
            return i
        self.out.extend(got)
        self.seen.setdefault(spec.target, []).append((f"--{name}", spec.target_value(values)))
        spelling = " ".join([f"--{name}", *values])
        self.spellings.update({t[2:]: spelling for t in got if t.startswith("--")})
        return i

    def _native(self, i: int, tok: str, name: str, inline: Optional[str], flat: str, dotted: bool) -> int:
        """One of orlhf's own flags, maybe under a dotted name; OpenRLHF's nargs="*" lists become one value."""
        if dotted:
            self.spellings[flat] = f"--{name}"
        else:
            self.spellings.pop(flat, None)  # given natively after another spelling: the native one counts
        arity = self.arity[flat]
        if arity == STAR:  # --target_modules q_proj v_proj: one comma-separated value
            values, i = _take(self.argv, i, inline, STAR)
            self.seen.setdefault(flat, []).append((f"--{name}", ",".join(values)))
            self.out.extend([f"--{flat}", ",".join(values)])
            return i
        values, j = _take(self.argv, i, inline, arity) if arity else ([], i + 1)
        if arity == 1 and inline is None and values and values[0].startswith("--"):
            values, j = [], i + 1  # an optional-value flag (--use_wandb) given bare
        self.seen.setdefault(flat, []).append((f"--{name}", " ".join(values) if values else "true"))
        self.out.append((f"--{flat}" + (f"={inline}" if inline is not None else "")) if dotted else tok)
        if inline is None:
            self.out.extend(self.argv[i + 1 : j])
        return j


def _same(values: list[str], expected: tuple[str, ...]) -> bool:
    if len(values) != len(expected):
        return False
    for v, e in zip(values, expected):
        try:
            if float(v) != float(e):
                return False
        except ValueError:
            if v != e:
                return False
    return True


def _conflicts(seen: dict[str, list[tuple[str, Optional[str]]]]) -> list[str]:
    """One option set under two spellings with different values."""
    problems = []
    for flag, uses in seen.items():
        spellings = {s.lstrip("-").replace("-", "_") for s, _ in uses}
        values = {v for _, v in uses}
        if len(spellings) > 1 and len(values) > 1:
            shown = ", ".join(f"{s} {v}" if v not in ("true", None) else s for s, v in uses)
            problems.append(f"{shown}: these set --{flag} to different values; give it once")
    return problems
