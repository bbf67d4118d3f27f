"""The rules of config/validation.py about the algorithm: advantage estimators, loss variants, reward shaping and
dynamic sampling, token budgets and the critic warm-up, and flags that do nothing without another one.

Each rule appends one message per problem to `out`, naming the flags and the fix.
"""

from __future__ import annotations

from orlhf.algo.is_correction import NAMED, refused
from orlhf.algo.registry import ESTIMATORS
from orlhf.algo.registry import names as estimator_names
from orlhf.config.train_config import TrainConfig


def estimators(cfg: TrainConfig, out: list[str]) -> None:
    est, n = cfg.ppo.advantage_estimator, cfg.ppo.n_samples_per_prompt
    spec = ESTIMATORS.get(est)
    if spec is None:  # the CLI's choices come from the registry; a config built in code may still miss
        out.append(f"--advantage_estimator {est!r} is not one of {', '.join(ESTIMATORS)}.")
        return
    if spec.needs_groups and n < 2:
        out.append(
            f"--advantage_estimator {est} compares samples of the same prompt: set "
            f"--n_samples_per_prompt to 2 or more (got {n}), or use "
            f"{' / '.join(estimator_names(needs_groups=False))}."
        )
    if spec.whole_response and cfg.ppo.gamma != 1.0:
        out.append(
            f"--advantage_estimator {est} scores whole responses (its baseline is on the final "
            f"score): it needs --gamma 1.0 (got {cfg.ppo.gamma})."
        )
    if not cfg.has_critic:
        if cfg.data.critic_pretrain is not None:
            out.append(
                f"--critic_pretrain is given but --advantage_estimator {est} uses no critic; "
                f"drop --critic_pretrain or use --advantage_estimator {_critic_estimators()}."
            )
        if cfg.placement.colocate_critic_reward:
            out.append(
                f"--colocate_critic_reward is given but --advantage_estimator {est} uses no critic; "
                f"drop it or use --advantage_estimator {_critic_estimators()}."
            )


def _critic_estimators() -> str:
    return " / ".join(estimator_names(needs_critic=True))


def _pair(value: tuple) -> tuple[float, float]:
    return float(value[0]), float(value[1])


def losses(cfg: TrainConfig, out: list[str]) -> None:
    """The loss variants (clip-higher, GSPO, IS correction, KL loss, optimizer knobs)."""
    ppo = cfg.ppo
    if ppo.eps_clip_low_high is not None:
        lo, hi = _pair(ppo.eps_clip_low_high)
        if not (0 < lo < 1 and hi > 0):
            out.append(
                f"--eps_clip_low_high LOW HIGH needs 0 < LOW < 1 and HIGH > 0 (got {lo} {hi}); DAPO uses 0.2 0.28."
            )
    lo, hi = _pair(ppo.vllm_is_truncated_threshold)
    if not 0 <= lo < hi:
        out.append(f"--vllm_is_truncated_threshold LOW HIGH needs 0 <= LOW < HIGH (got {lo} {hi}); e.g. 0.5 5.0.")
    if ppo.kl_target is not None and ppo.use_kl_loss and ppo.init_kl_coef == 0:
        out.append(
            "--kl_target adapts the KL coefficient multiplicatively, but --init_kl_coef is 0 so it stays 0 "
            "under --use_kl_loss: set --init_kl_coef > 0 or drop --kl_target."
        )
    for role in ("actor", "critic"):
        _optimizer(cfg, role, out)
    est = ppo.advantage_estimator
    spec = ESTIMATORS.get(est)
    if ppo.no_advantage_std_norm and spec is not None and not spec.whiten:
        out.append(
            f"--no_advantage_std_norm changes the batch whitening of "
            f"{' / '.join(estimator_names(whiten=True))}; "
            f"--advantage_estimator {est} is not whitened, so it would do nothing"
            + (f" (for {est} without the /std use --advantage_estimator {spec.std_free})." if spec.std_free else ".")
        )


def is_correction_and_kl_gradient(cfg: TrainConfig, out: list[str]) -> None:
    """OpenRLHF 0.11.2's IS-correction flags (algo/is_correction.py): agreeing with the v0.10.1 spelling when both
    are given, only the combinations 0.11.2 accepts, none that would do nothing; and the unbiased KL gradient."""
    ppo = cfg.ppo
    _is_correction(ppo, out)
    if ppo.kl_unbiased_gradient and not ppo.use_kl_loss:
        out.append(
            "--kl_unbiased_gradient changes the gradient of the KL loss, but without --use_kl_loss the KL is a "
            "reward penalty (no gradient of its own): add --use_kl_loss or drop --kl_unbiased_gradient."
        )


def _is_correction(ppo, out: list[str]) -> None:
    new = {"level": ppo.is_correction_level, "mode": ppo.is_correction_mode, "gating": ppo.is_correction_gating}
    given = {k: v for k, v in new.items() if v is not None}
    level, mode, gating = ppo.is_correction_choice()
    if ppo.enable_vllm_is_correction and given and ppo.is_correction_given() != NAMED[ppo.vllm_is_correction_type]:
        named = dict(zip(("level", "mode", "gating"), NAMED[ppo.vllm_is_correction_type]))
        shown = " ".join(f"--is_correction_{k} {v}" for k, v in given.items())
        out.append(
            f"--enable_vllm_is_correction --vllm_is_correction_type {ppo.vllm_is_correction_type} and {shown} ask "
            f"for different IS corrections (unset --is_correction_* flags mean OpenRLHF 0.11.2's off / mask / ratio). "
            "Give one spelling: --vllm_is_correction_type "
            f"{ppo.vllm_is_correction_type} is " + " ".join(f"--is_correction_{k} {v}" for k, v in named.items()) + "."
        )
        return
    problem = refused(level, mode, gating, ppo.vllm_is_truncated_threshold)
    if problem and mode == "clip":
        out.append(
            f"--is_correction_mode clip clamps each token's ratio: it needs --is_correction_level token and "
            f"--is_correction_gating ratio (got {level}, {gating}); a sequence's mean or a divergence can only "
            "mask: use --is_correction_mode mask."
        )
    elif problem:
        lo, hi = _pair(ppo.vllm_is_truncated_threshold)
        out.append(
            f"--is_correction_gating {gating} bounds a divergence from above only: give "
            f"--vllm_is_truncated_threshold 0 HIGH (--algo.advantage.is_correction_threshold 0 HIGH; got {lo} {hi})."
        )
    if level == "off":
        for k in ("mode", "gating"):
            if k in given:
                out.append(
                    f"--is_correction_{k} {given[k]} does nothing without an IS correction: add "
                    "--is_correction_level token or seq, or drop it."
                )
    elif ppo.policy_loss_type == "gspo":
        for k in ("mode", "gating"):
            if k in given:
                out.append(
                    f"--is_correction_{k} {given[k]} acts on the token-level PPO loss; --policy_loss_type gspo "
                    "corrects inside its sequence ratio (log pi - log pi_engine) instead, with no mode or gating. "
                    f"Drop --is_correction_{k} or use --policy_loss_type ppo."
                )


def _optimizer(cfg: TrainConfig, role: str, out: list[str]) -> None:
    """One trained role's optimizer settings (RoleOptimConfig.of): each problem named by the flag that set it, the
    role's own (--critic_max_norm) or the shared one (--max_norm), once when both roles share it."""
    o = cfg.optim.of(role, cfg.ppo)

    def flag(name: str, shared: str) -> str:
        own = f"{role}_{name}"
        return f"--{own}" if getattr(cfg.optim, own) is not None else f"--{shared}"

    def add(message: str) -> None:
        if message not in out:
            out.append(message)

    if o["max_norm"] < 0:
        add(f"{flag('max_norm', 'max_norm')} must be >= 0 (got {o['max_norm']}; 0: no clipping).")
    b1, b2 = _pair(o["adam_betas"])
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        add(
            f"{flag('adam_betas', 'adam_betas')} BETA1 BETA2 must both be in [0, 1) (got {b1} {b2}); "
            "OpenRLHF uses 0.9 0.95."
        )
    if o["weight_decay"] < 0:
        add(f"{flag('weight_decay', 'l2')} (weight decay) must be >= 0 (got {o['weight_decay']}).")
    if not 0 <= o["lr_warmup_ratio"] < 1:
        add(f"{flag('lr_warmup_ratio', 'lr_warmup_ratio')} must be in [0, 1) (got {o['lr_warmup_ratio']}).")
    if o["lr_scheduler"] == "constant" and o["lr_warmup_ratio"] > 0:
        add(
            f"{flag('lr_scheduler', 'lr_scheduler')} constant has no warm-up but "
            f"{flag('lr_warmup_ratio', 'lr_warmup_ratio')} is {o['lr_warmup_ratio']}: use constant_with_warmup, "
            "or a warm-up of 0."
        )
    if o["adam_eps"] <= 0:
        add(f"--{role}_adam_eps must be > 0 (got {o['adam_eps']}).")
    if not 0 <= o["min_lr_ratio"] <= 1:
        add(f"--{role}_min_lr_ratio must be in [0, 1] (got {o['min_lr_ratio']}).")
    if o["optim"] == "muon":
        if o["muon_lr"] <= 0 or not 0 <= o["muon_momentum"] < 1:
            add(f"--{role}_muon_lr must be > 0 and --{role}_muon_momentum in [0, 1).")
        if cfg.deepspeed.adam_offload:
            add(
                f"--{role}_optim muon with --adam_offload: DeepSpeed 0.19.8's Muon keeps its states on the device; "
                "drop one of them."
            )
        if cfg.deepspeed.enable_sleep and cfg.runtime.device != "cpu":
            add(
                f"--{role}_optim muon with --deepspeed_enable_sleep: DeepSpeed's offload_states moves FusedAdam's "
                "states only; drop one of them."
            )


def sampling(cfg: TrainConfig, out: list[str]) -> None:
    """Reward shaping by length, and DAPO's dynamic sampling."""
    ppo = cfg.ppo
    if ppo.overlong_buffer_len is not None:
        if not 0 < ppo.overlong_buffer_len <= ppo.generate_max_len:
            out.append(
                f"--overlong_buffer_len must be in (0, --generate_max_len {ppo.generate_max_len}] (got "
                f"{ppo.overlong_buffer_len})."
            )
        if ppo.overlong_penalty_factor < 0:
            out.append(f"--overlong_penalty_factor must be >= 0 (got {ppo.overlong_penalty_factor}).")
    coef = ppo.stop_properly_penalty_coef
    if coef is not None and coef > 1:
        out.append(
            f"--stop_properly_penalty_coef must be in [0, 1] (scales a cut response's reward) or < 0 (sets "
            f"it); got {coef}."
        )
    if not ppo.dynamic_filtering:
        return
    lo, hi = _pair(ppo.dynamic_filtering_reward_range)
    if not lo < hi:
        out.append(f"--dynamic_filtering_reward_range LOW HIGH needs LOW < HIGH (got {lo} {hi}).")
    if ppo.n_samples_per_prompt < 2:
        out.append(
            f"--dynamic_filtering drops prompts whose samples all score alike: it needs "
            f"--n_samples_per_prompt 2 or more (got {ppo.n_samples_per_prompt})."
        )
    if cfg.data.reward_pretrain is not None:
        out.append(
            "--dynamic_filtering scores samples while generating, with a reward function or server: it "
            "cannot use --reward_pretrain; use --remote_rm_url."
        )


def given_alone(cfg: TrainConfig, explicit: frozenset[str], out: list[str]) -> None:
    """Flags the user gave that the rest of the command line makes do nothing (they would be silently ignored)."""
    ppo = cfg.ppo
    g = ppo.vllm_generate_batch_size
    if g is not None and g != ppo.rollout_batch_size:
        k = g // ppo.rollout_batch_size if ppo.rollout_batch_size > 0 else 0
        if g < 1 or g % max(ppo.rollout_batch_size, 1) or k < 1:
            out.append(
                f"--vllm_generate_batch_size {g} must be a multiple of --rollout_batch_size {ppo.rollout_batch_size} "
                "(whole steps' batches generated together)."
            )
        elif not ppo.async_train or ppo.dynamic_filtering:
            out.append(
                f"--vllm_generate_batch_size {g} generates {k} steps' batches ahead into the --async_train queue: add "
                "--async_train (and no --dynamic_filtering, which fills each step itself), or drop it."
            )
        elif ppo.async_queue_size < k:
            out.append(
                f"--vllm_generate_batch_size {g} queues {k} batches at once: --async_queue_size must be >= {k} "
                f"(got {ppo.async_queue_size})."
            )
    if ppo.aux_loss_coef < 0:
        out.append(f"--aux_loss_coef must be >= 0 (got {ppo.aux_loss_coef}).")
    if not 0 < ppo.ema_beta < 1:
        out.append(f"--ema_beta must be in (0, 1) (got {ppo.ema_beta}); OpenRLHF's default is 0.992.")
    if "ema_beta" in explicit and not ppo.enable_ema and ppo.ema_beta != 0.992:  # OpenRLHF's default: harmless
        out.append("--ema_beta does nothing without --enable_ema: add --enable_ema or drop --ema_beta.")
    is_on = ppo.is_correction_enabled
    needs = [
        ("vllm_is_correction_type", "enable_vllm_is_correction", ppo.enable_vllm_is_correction),
        ("vllm_is_truncated_threshold", "enable_vllm_is_correction or --is_correction_level token|seq", is_on),
        ("dynamic_filtering_reward_range", "dynamic_filtering", ppo.dynamic_filtering),
        ("overlong_penalty_factor", "overlong_buffer_len", ppo.overlong_buffer_len is not None),
    ]
    for flag, needed, present in needs:
        if flag in explicit and not present:
            add = "add one" if " or " in needed else f"add --{needed}"
            out.append(f"--{flag} does nothing without --{needed}: {add} or drop --{flag}.")
    if "eps_clip" in explicit and ppo.eps_clip_low_high is not None:
        out.append(
            "--eps_clip and --eps_clip_low_high both set the PPO clip (--eps_clip_low_high LOW HIGH "
            "replaces --eps_clip on both sides): give only one of them."
        )
    if ppo.policy_loss_type == "gspo" and is_on:
        # OpenRLHF's GSPO (v0.10.1 to 0.11.2) takes the engine log-probs as the base of its sequence ratio and applies
        # no token weight, so neither the correction type nor its threshold has any effect there.
        for flag, given in (
            ("vllm_is_correction_type", ppo.vllm_is_correction_type != "tis"),
            ("vllm_is_truncated_threshold", False),
        ):
            if flag in explicit or given:
                out.append(
                    f"--{flag} {_shown(getattr(ppo, flag))} acts on the token-level PPO loss; "
                    "--policy_loss_type gspo with an IS correction corrects inside its sequence "
                    f"ratio (log pi - log pi_engine) instead, with no type or threshold. Drop --{flag} or "
                    "use --policy_loss_type ppo."
                )


def _shown(value) -> str:
    return " ".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


def dynamic_batch_and_freezing(cfg: TrainConfig, out: list[str]) -> None:
    """Token budgets and the critic warm-up. A budget below one sample's length is no error (OpenRLHF has none
    either): that sample gets a micro-batch of its own."""
    ds = cfg.deepspeed
    for flag, value in (
        ("--train_max_tokens_per_gpu", ds.train_max_tokens_per_gpu),
        ("--rollout_max_tokens_per_gpu", ds.rollout_max_tokens_per_gpu),
    ):
        if value is not None and value < 1:
            out.append(f"{flag} must be >= 1 token (got {value}).")
    n = cfg.ppo.freezing_actor_steps
    if n < -1:
        out.append(f"--freezing_actor_steps must be >= -1 (got {n}; -1: the actor is never frozen).")
    elif n >= 0 and not cfg.has_critic:
        out.append(
            f"--freezing_actor_steps {n} trains the critic alone in the first steps, but --advantage_estimator "
            f"{cfg.ppo.advantage_estimator} has no critic: nothing would train. Use --advantage_estimator gae "
            "or leave out --freezing_actor_steps."
        )
