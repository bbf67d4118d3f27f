"""The trained models' rules: OpenRLHF's DeepSpeed and data knobs (their ranges, what each needs, the ones that would
do nothing) and LoRA's. Part of validation.validate (config/validation.py), which reports every problem together."""

from __future__ import annotations

from orlhf.config.roles import trained_roles
from orlhf.config.train_config import TrainConfig


def deepspeed_knobs(cfg: TrainConfig, explicit: frozenset[str], out: list[str]) -> None:
    """OpenRLHF's DeepSpeed and data knobs: their ranges, what each needs, and the ones that would do nothing."""
    ds = cfg.deepspeed
    if cfg.data.dataloader_num_workers < 0:
        out.append(f"--dataloader_num_workers must be >= 0 (got {cfg.data.dataloader_num_workers}).")
    mem = cfg.logging.max_ckpt_mem
    if mem is not None and not mem >= 0:
        out.append(f"--max_ckpt_mem must be >= 0 GiB (got {mem}); leave it out for no disk budget.")
    if "gradient_checkpointing_use_reentrant" in explicit and not ds.gradient_checkpointing:
        out.append(
            "--gradient_checkpointing_use_reentrant does nothing without --gradient_checkpointing: add "
            "--gradient_checkpointing or drop --gradient_checkpointing_use_reentrant."
        )
    if ds.allow_slow_bf16 and not ds.bf16:
        out.append("--allow_slow_bf16 does nothing without --bf16: add --bf16 or drop --allow_slow_bf16.")
    if ds.use_liger_kernel and cfg.runtime.device == "cpu":
        out.append("--use_liger_kernel needs CUDA GPUs (Liger's kernels are Triton's); drop it on --device cpu.")
    _zero_knobs(cfg, out)


def _zero_knobs(cfg: TrainConfig, out: list[str]) -> None:
    """--zpg and --grad_accum_dtype against each trained group's ZeRO stage and rank count."""
    from orlhf.config.worker_config import role_ranks, zero_stage_of

    ds = cfg.deepspeed
    stages = {r: (zero_stage_of(cfg, r, role_ranks(cfg, r), "cuda"), role_ranks(cfg, r)) for r in trained_roles(cfg)}
    if ds.zpg < 1:
        out.append(f"--zpg must be >= 1 (got {ds.zpg}); 1 turns ZeRO++ hierarchical partitioning off.")
    elif ds.zpg > 1:
        zero3 = {r: ranks for r, (stage, ranks) in stages.items() if stage == 3 and ranks > 1}
        if not zero3:
            out.append(
                f"--zpg {ds.zpg} does nothing here: ZeRO++ hierarchical partitioning applies to trained models under "
                "ZeRO-3 over several ranks, and no trained group is one. Drop --zpg, or train on more ranks "
                "(ZeRO-3 is the default for them; --zero_stage 3)."
            )
        for role, ranks in zero3.items():
            if ranks % min(ds.zpg, ranks):
                out.append(
                    f"--zpg {ds.zpg} must divide the {role}'s {ranks} ranks (ZeRO++ partitions within equal groups "
                    "of ranks, e.g. the GPUs of one node)."
                )
    model_dtype = "bf16" if ds.bf16 else "fp32"
    if ds.grad_accum_dtype is not None and ds.grad_accum_dtype != model_dtype:
        for role, (stage, _ranks) in stages.items():
            if stage == 0:
                out.append(
                    f"--grad_accum_dtype {ds.grad_accum_dtype}: the {role} trains without ZeRO (stage 0), where "
                    f"DeepSpeed accumulates gradients in the model's dtype ({model_dtype}) only; use --zero_stage 1 "
                    "or more, or drop --grad_accum_dtype."
                )


def lora(cfg: TrainConfig, out: list[str]) -> None:
    """LoRA's ranges and what needs it. Module names are checked against the model at start (workers/lora.py)."""
    lo = cfg.lora
    if lo.lora_rank < 0:
        out.append(f"--lora_rank must be >= 0 (got {lo.lora_rank}); 0 trains every weight.")
    if not lo.enabled:
        changed = [
            f"--{name}"
            for name, default in (("lora_alpha", 16), ("lora_dropout", 0.0), ("target_modules", "all-linear"))
            if getattr(lo, name) != default
        ] + [f"--{name}" for name in ("load_in_4bit", "lora_save_merged") if getattr(lo, name)]
        if changed:
            out.append(f"{' '.join(changed)} configure a LoRA adapter: add --lora_rank R (> 0), or drop them.")
        return
    if lo.lora_alpha <= 0:
        out.append(f"--lora_alpha must be > 0 (got {lo.lora_alpha}).")
    if not 0 <= lo.lora_dropout < 1:
        out.append(f"--lora_dropout must be in [0, 1) (got {lo.lora_dropout}).")
    if not lo.targets:
        out.append("--target_modules is empty: give all-linear or module names (q_proj v_proj).")
    elif lo.targets != "all-linear" and "all-linear" in lo.targets:
        out.append("--target_modules: all-linear already names every Linear layer; give it alone or names only.")
    if lo.load_in_4bit:
        if cfg.runtime.device == "cpu":
            out.append("--load_in_4bit needs CUDA GPUs (bitsandbytes' 4-bit kernels); drop it on --device cpu.")
        if not cfg.deepspeed.bf16:
            out.append("--load_in_4bit computes in bfloat16: add --bf16 (OpenRLHF's --param_dtype bf16).")
        from orlhf.config.worker_config import role_ranks, zero_stage_of

        if any(zero_stage_of(cfg, r, role_ranks(cfg, r), "cuda") == 3 for r in trained_roles(cfg)):
            out.append(
                "--load_in_4bit: ZeRO-3 cannot partition bitsandbytes' packed 4-bit weights; add --zero_stage 2 "
                "(the adapter's gradients and Adam states are small) or drop --load_in_4bit."
            )
