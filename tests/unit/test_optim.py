"""--l2 weight decay groups: weight matrices decay; biases and norm weights do not (OpenRLHF's grouping)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from orlhf.config.worker_config import role_config
from orlhf.workers.base import DeepSpeedWorker
from orlhf.workers.optim import decay_groups


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=50,
        attention_bias=True,
    )  # q/k/v/o get biases
    return LlamaForCausalLM(cfg)


def test_biases_and_norm_weights_are_not_decayed():
    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters are in no group
    groups = decay_groups(model.named_parameters(), 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed, exempt = ({names[id(p)] for p in g["params"]} for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    # 1 layer: input_layernorm, post_attention_layernorm, the final model.norm; 4 attention biases
    assert exempt == {
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        *(f"model.layers.0.self_attn.{x}_proj.bias" for x in "qkvo"),
    }
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert "model.embed_tokens.weight" not in decayed | exempt
    assert len(decayed) + len(exempt) == sum(p.requires_grad for p in model.parameters())
    # no decay: one group, every trainable parameter (the optimizer as it was before --l2)
    (only,) = decay_groups(model.named_parameters(), 0.0)
    assert len(only["params"]) == len(decayed) + len(exempt) and only["weight_decay"] == 0.0


def test_the_worker_optimizer_steps_norms_without_decay():
    """The worker's optimizer (AdamW here) with --l2 0.5 and lr 0.1, zero gradients: Adam's update is 0, so only
    decoupled decay moves a weight: w <- w * (1 - lr * wd) = 0.95 w. Norm weights and biases stay put."""
    cfg = role_config("actor", model_path="m", device="cpu", learning_rate=0.1, weight_decay=0.5)
    model = tiny_llama()
    opt = DeepSpeedWorker._make_optimizer(type("W", (), {"cfg": cfg})(), model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = dict(model.named_parameters())
    assert torch.allclose(
        after["model.layers.0.mlp.up_proj.weight"], 0.95 * before["model.layers.0.mlp.up_proj.weight"]
    )
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert torch.equal(after[name], before[name]), name


def test_cpu_adamw_is_the_fused_kernel_with_the_same_update():
    """On CPU the worker's AdamW is torch's fused kernel (one pass over the states), and three steps of it move the
    weights as the default single-tensor AdamW does, up to float rounding."""
    cfg = role_config("actor", model_path="m", device="cpu", learning_rate=0.01, weight_decay=0.0)
    worker = type("W", (), {"cfg": cfg})()
    models = [tiny_llama(), tiny_llama()]
    models[1].load_state_dict(models[0].state_dict())
    fused = DeepSpeedWorker._make_optimizer(worker, models[0])
    assert all(g["fused"] for g in fused.param_groups)
    plain = torch.optim.AdamW(models[1].parameters(), lr=0.01, betas=cfg.train.adam_betas, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        fused.step()
        plain.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_muon_on_cpu_steps_its_adam_half_with_torchs_adamw():
    """No C++ op to build on CPU: DeepSpeed's torch_adam there; on GPUs its default (FusedAdam)."""
    from types import SimpleNamespace

    from orlhf.workers.deepspeed_setup import muon_optimizer

    t = SimpleNamespace(muon_lr=0.02, learning_rate=1e-3, muon_momentum=0.95, adam_betas=(0.9, 0.95), adam_eps=1e-8)
    t.weight_decay = 0.0
    assert muon_optimizer(t, "cpu")["params"]["torch_adam"] is True
    assert "torch_adam" not in muon_optimizer(t, "cuda")["params"]
