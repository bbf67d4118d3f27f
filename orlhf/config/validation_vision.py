"""The rules of config/validation.py about vision-language runs (--max_images_per_prompt > 0: image prompts, a model
with a vision encoder): what they need, and the features that do not take image prompts yet, each refused by name
with what to do instead. Whether --pretrain is a vision-language model is read from its files, before Ray starts
(launch/preflight.py)."""

from __future__ import annotations

from orlhf.algo.registry import names as estimator_names
from orlhf.config.train_config import TrainConfig
from orlhf.config.validation_rollout import chosen_by

NOT_YET = "is not supported with vision-language prompts (--max_images_per_prompt > 0) yet"


def vision(cfg: TrainConfig, explicit: frozenset[str], out: list[str]) -> None:
    d, n = cfg.data, cfg.data.max_images_per_prompt
    if n < 0:
        out.append(f"--max_images_per_prompt must be >= 0 (got {n}; 0: text prompts only).")
        return
    if n == 0:
        if d.freeze_visual_encoder:
            out.append(
                "--freeze_visual_encoder freezes a vision-language model's vision encoder, and "
                "--max_images_per_prompt is 0 (a text run): add --max_images_per_prompt N or drop "
                "--freeze_visual_encoder."
            )
        if "image_key" in explicit and d.image_key != "images":  # OpenRLHF's default: harmless
            out.append(
                f"--image_key {d.image_key} does nothing without --max_images_per_prompt N (> 0): add it or drop "
                "--image_key."
            )
        return
    if d.uses_demo:
        out.append(
            f"--max_images_per_prompt {n} needs --pretrain a vision-language model: the built-in demo is a text "
            "model (`orlhf make-demo --vlm DIR` builds a vision-language one and prints its command)."
        )
    out.extend(_unsupported(cfg))


def _unsupported(cfg: TrainConfig) -> list[str]:
    """Features that do not take image prompts yet: (given, message) each."""
    d, ppo = cfg.data, cfg.ppo
    rules = [
        (
            cfg.has_critic,
            f"--advantage_estimator {ppo.advantage_estimator} trains a critic, which {NOT_YET}: use a critic-free "
            f"estimator (--advantage_estimator {' / '.join(estimator_names(needs_critic=False))}).",
        ),
        (
            d.reward_pretrain is not None,
            f"--reward_pretrain (a reward model) {NOT_YET}: score with a reward function or server "
            "(--remote_rm_url reward.py or http://...).",
        ),
        (cfg.deepspeed.packing_samples, f"--packing_samples {NOT_YET}: drop --packing_samples."),
        (
            d.agent_func_path is not None,
            f"--agent_func_path (multi-turn agents) {NOT_YET}: drop it, or train the agent on text prompts.",
        ),
        (
            not cfg.rollout.takes_images,
            f"{chosen_by(cfg)} ({_generation(cfg)}) {NOT_YET}: generate with vLLM engines (--vllm_num_engines N).",
        ),
        (ppo.partial_rollout, f"--partial_rollout {NOT_YET}: drop --partial_rollout."),
        (
            cfg.lora.enabled,
            f"--lora_rank {cfg.lora.lora_rank} (LoRA) {NOT_YET}: drop --lora_rank to train every weight "
            "(--freeze_visual_encoder keeps the vision encoder fixed).",
        ),
        (
            d.prompt_overflow == "truncate",
            f"--prompt_overflow truncate {NOT_YET} (a cut prompt loses its image tokens' alignment): use "
            "--prompt_overflow skip (the default) or raise --prompt_max_len.",
        ),
    ]
    return [message for given, message in rules if given]


def _generation(cfg: TrainConfig) -> str:
    return "generation in the actor's ranks" if cfg.rollout.in_actor else f"the {cfg.rollout_name} rollout backend"
