"""LoRA's pure parts (workers/lora.py) on tiny models without DeepSpeed: the merge math against peft's own merge,
the names the engines get (tied embeddings, vLLM's fused q/k/v and gate/up, an MoE family), what a sync sends,
the adapter switch that makes the reference, and the refusals of --target_modules."""

import pytest
import torch
import transformers
from torch import nn

from orlhf.config.flags import build_config
from orlhf.config.train_config import ConfigError
from orlhf.config.worker_slices import LoraSlice
from orlhf.workers import lora

VLLM_LLAMA = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def tiny(family: str = "llama", tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    dense = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        tie_word_embeddings=tied,
    )
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **dense, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4, decoder_sparse_step=1
        )
    else:
        config = transformers.LlamaConfig(**dense)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def with_adapter(model: nn.Module, targets="all-linear", rank: int = 4, alpha: int = 8) -> nn.Module:
    """An adapter whose B is not zero (peft starts it at zero), so merging changes the weights."""
    peft_model = lora.apply_lora(model, LoraSlice(rank=rank, alpha=alpha, target_modules=targets))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft_model


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))


def test_delta_is_scaling_times_b_at_a_by_hand():
    a = torch.tensor([[1.0, 0.0, 2.0]])  # (r=1, in=3)
    b = torch.tensor([[1.0], [3.0]])  # (out=2, r=1)
    # B @ A = [[1, 0, 2], [3, 0, 6]]; times scaling 0.5
    assert torch.equal(lora.lora_delta(a, b, 0.5), torch.tensor([[0.5, 0.0, 1.0], [1.5, 0.0, 3.0]]))
    assert torch.equal(
        lora.lora_delta(a, b, 0.5, fan_in_fan_out=True), torch.tensor([[0.5, 1.5], [0.0, 0.0], [1.0, 3.0]])
    )


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: Conv1D layers, fan_in_fan_out
def test_merged_state_equals_peft_merge_and_unload(family):
    model = with_adapter(tiny(family))
    adapted_logits = logits(model, IDS)
    ours = lora.merged_state(model, dict(model.state_dict()))
    theirs = model.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in theirs) < 1e-6
    plain = tiny(family)
    plain.load_state_dict(ours)
    assert (logits(plain, IDS) - adapted_logits).abs().max().item() < 1e-5  # the merged model is the adapted one


def test_plain_names_of_an_actor_and_of_a_value_model_backbone():
    assert lora.plain_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert lora.plain_name("base_model.model.model.norm.weight") == "model.norm.weight"
    assert (
        lora.plain_name("model.base_model.model.layers.1.mlp.up_proj.base_layer.bias")
        == "model.layers.1.mlp.up_proj.bias"
    )


class Worker:
    """What merged_groups reads from a DeepSpeedWorker: its module, rank and ZeRO stage."""

    def __init__(self, module):
        self.module, self.rank, self.zero3 = module, 0, False


def sent(model, packed) -> list[str]:
    plan = lora.sync_plan(model, packed)
    return [n for g in lora.merged_groups_meta(Worker(model), plan) for n, _, _ in g]


def test_a_sync_sends_the_adapted_modules_and_their_fused_siblings_only():
    model = with_adapter(tiny(tied=True), targets=("q_proj", "down_proj"))
    names = sent(model, VLLM_LLAMA)
    layer0 = [n for n in names if ".layers.0." in n]
    # q_proj is adapted: k and v go too (vLLM's qkv_proj must get all three); down_proj alone; no gate/up, no o_proj
    assert layer0 == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in names)  # tied head: never sent
    assert len(names) == 8


def test_the_sent_tensors_are_the_merged_weights_under_checkpoint_names():
    model = with_adapter(tiny(), targets=("q_proj",))
    plan = lora.sync_plan(model, VLLM_LLAMA)
    got = {n: t for g in lora.merged_groups(Worker(model), plan) for n, t in g}
    merged = model.merge_and_unload().state_dict()
    assert set(got) == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkv"}
    assert max((got[k] - merged[k]).abs().max().item() for k in got) < 1e-6


def test_an_engine_without_a_fused_module_map_gets_whole_layers():
    model = with_adapter(tiny(), targets=("q_proj",))
    names = sent(model, None)
    assert "model.layers.0.input_layernorm.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_an_moe_family_sends_attention_and_shared_expert_never_the_experts():
    model = with_adapter(tiny("qwen2_moe"))
    names = sent(model, VLLM_LLAMA)
    layer0 = {n.split("layers.0.")[1] for n in names if "layers.0." in n}
    assert layer0 == {
        "self_attn.q_proj.weight",
        "self_attn.q_proj.bias",  # Qwen2's q/k/v have biases: a fused module gets all its tensors
        "self_attn.k_proj.weight",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.weight",
        "self_attn.v_proj.bias",
        "self_attn.o_proj.weight",
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight",
        "mlp.shared_expert_gate.weight",
    }


def test_adapter_off_is_the_base_model():
    base = tiny()
    base_logits = logits(base, IDS)
    model = with_adapter(tiny())
    assert (logits(model, IDS) - base_logits).abs().max().item() > 1e-3  # the adapter changes the policy
    with lora.adapter_off(model):
        assert torch.equal(logits(model, IDS), base_logits)
    assert (logits(model, IDS) - base_logits).abs().max().item() > 1e-3  # and is back on after
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())  # trainable flags kept


@pytest.mark.parametrize(
    "targets, message",
    [
        (("qproj",), "--target_modules qproj: no module of the model has that name. Its Linear layers: down_proj"),
        (("lm_head",), "--target_modules lm_head is the output head, which this model ties"),
        (("embed_tokens",), "--target_modules embed_tokens is a Embedding, not a Linear layer"),
    ],
)
def test_target_modules_that_name_nothing_adaptable_are_refused_with_the_model_linears(targets, message):
    with pytest.raises(lora.LoraTargetError, match=message.replace("(", r"\(")):
        lora.check_targets(tiny(tied=True), targets)
    lora.check_targets(tiny(), ("q_proj", "v_proj"))
    lora.check_targets(tiny(), ("q_proj", "lm_head"))  # an untied head may have an adapter
    lora.check_targets(tiny(), "all-linear")


def test_every_bad_target_module_is_named_in_one_message():
    with pytest.raises(lora.LoraTargetError) as err:
        lora.check_targets(tiny(tied=True), ("q_proj", "qproj", "lm_head", "embed_tokens", "vproj"))
    assert str(err.value).startswith(
        "--target_modules qproj: no module of the model has that name; --target_modules lm_head is the output head, "
    )
    for part in ("--target_modules embed_tokens is a Embedding", "--target_modules vproj: no module", "down_proj"):
        assert part in str(err.value)
    assert "q_proj:" not in str(err.value)  # the good entry is not named


def test_an_untied_head_adapter_is_sent_merged():
    model = with_adapter(tiny(), targets=("lm_head",))
    assert sent(model, VLLM_LLAMA) == ["lm_head.weight"]


def test_folder_check_builds_the_model_on_the_meta_device(tmp_path):
    tiny().save_pretrained(tmp_path / "m")
    lora.check_folder_targets(str(tmp_path / "m"), ("q_proj",))
    with pytest.raises(lora.LoraTargetError, match="Its Linear layers: down_proj gate_proj k_proj o_proj q_proj"):
        lora.check_folder_targets(str(tmp_path / "m"), ("query",), causal_lm=False)


@pytest.mark.parametrize(
    "flags, problem",
    [
        ({"lora_rank": 8, "load_in_4bit": True, "device": "cpu"}, "--load_in_4bit needs CUDA GPUs"),
        ({"lora_rank": 8, "load_in_4bit": True, "device": "cuda"}, "--load_in_4bit computes in bfloat16"),
        ({"lora_save_merged": True}, "--lora_save_merged configure a LoRA adapter"),
        ({"lora_rank": 8, "lora_dropout": 1.0}, "--lora_dropout must be in [0, 1)"),
        ({"lora_rank": 8, "target_modules": "all-linear q_proj"}, "all-linear already names every Linear layer"),
    ],
)
def test_lora_flag_rules(flags, problem):
    with pytest.raises(ConfigError) as e:
        build_config(flags)
    assert any(problem in p for p in e.value.problems), e.value.problems


def test_with_lora_the_reference_group_is_not_placed_and_the_actor_scores_it():
    from orlhf.config.roles import active_roles

    cfg = build_config(
        {"lora_rank": 8, "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "use_kl_loss": True}
    )
    assert cfg.reference_from_actor and active_roles(cfg) == ["actor"]
    full = build_config({"advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "use_kl_loss": True})
    assert not full.reference_from_actor and active_roles(full) == ["actor", "ref"]


def test_the_run_names_bad_targets_once_for_an_actor_and_critic_of_one_folder():
    from orlhf.config.resolve import finish_config
    from orlhf.config.train_config import ConfigError
    from orlhf.launch.preflight import check_lora_targets

    flags = {"device": "cpu", "lora_rank": 4, "target_modules": "q_proj qproj vproj"}
    cfg = finish_config(flags, set(flags))  # the demo: the critic starts from the actor's folder
    with pytest.raises(ConfigError) as err:
        check_lora_targets(cfg)
    [problem] = err.value.problems
    assert problem.startswith("--target_modules qproj: no module of the model has that name; --target_modules vproj:")
    assert problem.endswith(f"(actor: {cfg.data.pretrain}, critic: {cfg.data.pretrain})")
