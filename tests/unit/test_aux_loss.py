"""--aux_loss_coef: the actor's loss on a tiny Qwen2-MoE adds coef x the router's load-balancing loss of the same
forward (per micro-batch, as OpenRLHF's `loss += output.aux_loss * aux_loss_coef`), and the routers get its gradient;
a dense model is refused before anything starts."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import transformers

from orlhf.algo.losses import LossNorm
from orlhf.config.worker_config import worker_config
from orlhf.trainer.experience import ExperienceConfig, make_experience, rollouts_to_batch
from orlhf.workers.batching import trim
from orlhf.workers.policy import PolicyWorker
from tests.unit.test_is_correction_path import finished, rollouts

FLAGS = {"advantage_estimator": "group_norm", "n_samples_per_prompt": 2}


def tiny_moe():
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=40,
        output_router_logits=True,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def loss_of(model, coef: float):
    cfg = finished({**FLAGS, "aux_loss_coef": coef})
    batch, _ = rollouts_to_batch(rollouts([[0.0] * 4] * 4), pad_id=0)
    old = torch.zeros(batch.action_mask.shape)  # (4, A) old log-probs: any, the ratio is not what is checked
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    exp, _ = make_experience(batch, scores, old, None, None, 0.0, ExperienceConfig.from_ppo(cfg.ppo))
    mb = trim(exp.index(torch.arange(4)).split([4])[0])
    worker = SimpleNamespace(cfg=worker_config(cfg, "actor"), engine=model, shared_prompt_train=False)
    handle = model.register_forward_hook(lambda m, a, out: setattr(worker, "last_aux_loss", out.aux_loss))
    try:
        return PolicyWorker._loss(worker, mb, LossNorm(tokens=float(exp.action_mask.sum()), seqs=4.0), kl_coef=0.0)
    finally:
        handle.remove()


def test_the_router_loss_is_added_with_its_coefficient_and_trains_the_routers():
    model = tiny_moe()
    plain, _ = loss_of(model, 0.0)
    with_aux, stats = loss_of(model, 0.5)
    aux = stats["aux_loss"]
    assert aux > 0  # the load-balancing loss of 4 experts, top-2: about num_experts x sum(f_i P_i) >= 1 when even
    assert with_aux.item() == pytest.approx(plain.item() + 0.5 * aux, abs=1e-6)
    with_aux.backward()
    router = next(p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_a_dense_model_is_refused_before_anything_starts(tmp_path):
    from orlhf.config.train_config import ConfigError
    from orlhf.launch.preflight import check_moe_for_aux_loss

    transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    cfg = finished({**FLAGS, "aux_loss_coef": 0.01})
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain=str(tmp_path)))
    with pytest.raises(ConfigError, match="is not a mixture-of-experts model"):
        check_moe_for_aux_loss(cfg)
    moe = tmp_path / "moe"
    tiny_moe().config.save_pretrained(moe)
    check_moe_for_aux_loss(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain=str(moe))))
