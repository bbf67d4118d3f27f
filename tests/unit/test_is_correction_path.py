"""The engine's log-probs reach the actor's loss under --enable_vllm_is_correction: rollouts (engine log-probs)
-> rollouts_to_batch -> make_experience (keeps them) -> Experience split / trimmed as the trainer does ->
PolicyWorker._loss on a real tiny model -> policy_loss_terms weights the tokens by pi_old / pi_engine."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from orlhf.algo.losses import LossNorm
from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.config.worker_config import worker_config
from orlhf.trainer.experience import ExperienceConfig, make_experience, rollouts_to_batch
from orlhf.types import Rollout
from orlhf.workers.batching import trim
from orlhf.workers.causal_lm import action_logits, gather_log_probs
from orlhf.workers.policy import PolicyWorker

FLAGS = {
    "advantage_estimator": "group_norm",
    "n_samples_per_prompt": 2,
    "enable_vllm_is_correction": True,
    "vllm_is_correction_type": "icepop",
    "vllm_is_truncated_threshold": (0.5, 2.0),
}


def finished(flags):
    """The validated config of these flags, with a model path (the worker slices need one; no model is read)."""
    cfg = build_config(flags, set(flags))
    return resolve_device(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain="model")), "cpu")


def tiny_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=40,
        )
    ).eval()


RESPONSES = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]]


def rollouts(engine_logprobs, responses=RESPONSES):
    """2 prompts x 2 samples, 4 response tokens each unless given; engine log-probs as given (a list per row)."""
    return [
        Rollout(i // 2, [1, 2, 3], r, lp[: len(r)], True) for i, (r, lp) in enumerate(zip(responses, engine_logprobs))
    ]


def actor_loss(model, engine_shift, flags=FLAGS, responses=RESPONSES):
    """(loss, stats) of the actor's loss on one experience whose engine log-probs are the trainer's old ones
    plus engine_shift[row] (so pi_old / pi_engine = exp(-shift) on every token of that row)."""
    cfg = finished(flags)
    actor = worker_config(cfg, "actor")
    batch, _ = rollouts_to_batch(rollouts([[0.0] * 4] * 4, responses), pad_id=0)
    with torch.no_grad():
        old = gather_log_probs(action_logits(model, batch, 1.0), batch.sequences[:, -batch.num_actions :])  # (4, A)
    engine = (old + torch.tensor(engine_shift).unsqueeze(-1)).tolist()
    batch, engine_lp = rollouts_to_batch(rollouts(engine, responses), pad_id=0)  # as the controller gets them
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    # The experience keeps the engine's log-probs under either spelling of the correction (the trainer's
    # ExperienceConfig.from_ppo reads --enable_vllm_is_correction only: test_experience_keeps_them_under_...).
    exp_cfg = dataclasses.replace(ExperienceConfig.from_ppo(cfg.ppo), keep_rollout_log_probs=True)
    exp, _ = make_experience(batch, scores, old, None, None, 0.0, exp_cfg, rollout_log_probs=engine_lp)
    assert exp.rollout_log_probs is not None
    mb = trim(exp.index(torch.arange(4)).split([4])[0])  # the trainer's shuffle / split / trim keep them
    worker = SimpleNamespace(cfg=actor, engine=model, shared_prompt_train=False)  # what _loss reads
    tokens = float(exp.action_mask.sum())
    return PolicyWorker._loss(worker, mb, LossNorm(tokens=tokens, seqs=4.0), kl_coef=0.0)


def test_engine_log_probs_weight_the_actor_loss():
    model = tiny_model()
    # group_norm, scores (1, 0) per prompt: A = +-0.5 / std(1, 0) = +-0.5 / 0.7071 = +-0.7071 on every token.
    # Same weights as pi_old: ratio 1, per-token loss -A. Engine == trainer: w = 1, inside [0.5, 2]: kept,
    # token mean over 16 tokens of -A = 0 (the advantages cancel).
    loss, stats = actor_loss(model, [0.0, 0.0, 0.0, 0.0])
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and stats["is_cut_frac"] == 0.0
    # Row 0 (A = +0.7071): engine log-probs higher by log 4, w = 1/4 < 0.5: icepop drops its 4 tokens.
    # Loss = -(4 x (-0.7071) + 4 x 0.7071 + 4 x (-0.7071)) / 16 = 0.7071 / 4 = 0.1768; a quarter of tokens cut.
    loss, stats = actor_loss(model, [math.log(4.0), 0.0, 0.0, 0.0])
    assert loss.item() == pytest.approx(0.5**0.5 / 4, rel=1e-4) and stats["is_cut_frac"] == 0.25
    assert loss.requires_grad  # a training loss, not a figure
    # Row 1 (A = -0.7071), engine lower by log 1.5: w = 1.5, inside: weighted, loss = -(1.5 - 1) x 4 x (-0.7071)
    # / 16 = +0.0884 (icepop multiplies by w where it keeps the token).
    loss, stats = actor_loss(model, [0.0, -math.log(1.5), 0.0, 0.0])
    assert loss.item() == pytest.approx(0.5 * 0.5**0.5 / 4, rel=1e-4) and stats["is_cut_frac"] == 0.0


# OpenRLHF 0.11.2's spelling of icepop (--algo.advantage.is_correction_level token, mode mask by default)
FLAGS_0112 = {
    "advantage_estimator": "group_norm",
    "n_samples_per_prompt": 2,
    "is_correction_level": "token",
    "vllm_is_truncated_threshold": (0.5, 2.0),
}


def test_the_0112_flags_weight_the_actor_loss_as_the_named_scheme():
    # Row 0 dropped (w = 1/4), row 1 weighted by 1.5: the icepop figures of the test above, under the new flags.
    model = tiny_model()
    loss, stats = actor_loss(model, [math.log(4.0), -math.log(1.5), 0.0, 0.0], FLAGS_0112)
    assert worker_config(finished(FLAGS_0112), "actor").loss.is_correction == "icepop"
    # -(0 + 4 x 1.5 x (-0.7071) + 4 x (-0.7071) + 4 x 0.7071) / 16 = 1.5 x 0.7071 / 4 = 0.2652
    assert loss.item() == pytest.approx(1.5 * 0.5**0.5 / 4, rel=1e-4) and stats["is_cut_frac"] == 0.25
    # seq level with the default mask: row 0's geometric mean 1/4 is outside [0.5, 2]: 1 of 4 sequences cut.
    _, stats = actor_loss(model, [math.log(4.0), 0.0, 0.0, 0.0], {**FLAGS_0112, "is_correction_level": "seq"})
    assert stats["is_cut_frac"] == 0.25


def test_experience_keeps_the_engine_log_probs_under_the_0112_flags():
    assert ExperienceConfig.from_ppo(finished(FLAGS_0112).ppo).keep_rollout_log_probs


def test_the_logged_policy_loss_is_the_aggregate_optimized():
    """--actor.loss_agg_mode seq-mean-token-mean: the logged loss is this micro-batch's sequence mean, the mode the
    loss is optimized in, not a token mean of the terms."""
    model = tiny_model()
    flags = {"advantage_estimator": "group_norm", "n_samples_per_prompt": 2}
    lengths = [[5, 6, 7, 8], [9, 10], [13, 14, 15], [17]]  # 4, 2, 3, 1 tokens: 10
    # ratio 1, no correction: per-token loss -A, A = +-0.7071 by row (+, -, +, -).
    # token mean: (-4 + 2 - 3 + 1) x 0.7071 / 10 = -0.2828;  sequence mean: (-1 + 1 - 1 + 1) x 0.7071 / 4 = 0.
    loss, stats = actor_loss(model, [0.0] * 4, flags, lengths)
    assert stats["loss"] == pytest.approx(-0.4 * 0.5**0.5, abs=1e-5) and loss.item() == pytest.approx(stats["loss"])
    loss, stats = actor_loss(model, [0.0] * 4, {**flags, "actor_loss_agg_mode": "seq-mean-token-mean"}, lengths)
    assert stats["loss"] == pytest.approx(0.0, abs=1e-5) and loss.item() == pytest.approx(0.0, abs=1e-5)


def test_without_the_flag_the_engine_log_probs_stay_out_of_the_loss():
    flags = {k: v for k, v in FLAGS.items() if not k.startswith(("enable_vllm", "vllm_is"))}
    cfg = finished(flags)
    batch, engine_lp = rollouts_to_batch(rollouts([[-1.0] * 4] * 4), pad_id=0)
    exp, _ = make_experience(
        batch,
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        torch.zeros(4, 4),
        None,
        None,
        0.0,
        ExperienceConfig.from_ppo(cfg.ppo),
        rollout_log_probs=engine_lp,
    )
    assert exp.rollout_log_probs is None and worker_config(cfg, "actor").loss.is_correction is None
