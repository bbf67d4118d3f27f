"""--router_replay's hooks on the actor's mixture-of-experts routers (workers/router_replay.py), on tiny transformers
models of the three families (2 layers, 4 experts, top-2, random weights; no DeepSpeed, no engine).

What replay must do: route each recorded token to its recorded experts and nothing else; weigh them with the
trainer's own softmax at those experts (renormalized as the family does), so the router still gets its gradient;
follow the tokens on every forward path (plain, packed, each prompt once); change nothing where the recorded experts
are the router's own; give a gradient-checkpointing recompute the same experts. R2 records what the routers chose.
"""

import pytest
import torch
import transformers

from orlhf.types import SequenceBatch
from orlhf.workers.causal_lm import model_logits
from orlhf.workers.router_replay import RouterReplay, install, replay_of, routed

FAMILIES = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, decoder_sparse_step=1),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=16, num_experts=4, head_dim=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4)),
}
L, K, E = 2, 2, 4


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=L,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=K,
        max_position_embeddings=64,
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for _, m in model.named_modules():  # routers start at zero in Qwen's init: give them a choice to make
        if type(m).__name__.endswith("TopKRouter"):
            torch.nn.init.normal_(m.weight, std=1.0)
    return model.eval()


def batch(routing=None) -> SequenceBatch:
    """4 rows, prompts of 4 columns (rows 0-1 and 2-3 share one; the second left-padded by 1), 3 action columns."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 50, (4, 7), generator=g)
    ids[1, :4], ids[3, :4] = ids[0, :4], ids[2, :4]
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[2:, 0] = 0
    mask[1, 6] = 0
    return SequenceBatch(ids, mask, mask[:, 4:].bool(), routing=routing)


class Experts:
    """What each layer's experts module receives: (layer, top_k_index, top_k_weights) per forward."""

    def __init__(self, model):
        self.calls = []
        for name, m in model.named_modules():
            if type(m).__name__.endswith("Experts"):
                layer = int(name.split("layers.")[1].split(".")[0])
                m.register_forward_pre_hook(lambda mod, args, layer=layer: self.calls.append((layer, *args[1:])))


def native_routing(model, b: SequenceBatch) -> torch.Tensor:
    """(B, T, L, K) the routers' own choice on b's plain forward."""
    seen = Experts(model)
    with torch.no_grad():
        model_logits(model, b)
    return torch.stack([idx.view(*b.sequences.shape, K) for _, idx, _ in seen.calls], dim=2).to(torch.int16)


def shifted(routing: torch.Tensor) -> torch.Tensor:
    """Other experts for every token: each expert id moved by one (a permutation: the K stay distinct)."""
    return ((routing.long() + 1) % E).to(torch.int16)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_experts_are_used_and_weighed_by_the_trainer_softmax(family):
    model = install(tiny(family), "R3")
    plain = batch()
    own = native_routing(model, plain)
    target = shifted(own)
    target[0, 2] = -1  # one token without a record: the router's own choice there
    seen = Experts(model)
    with torch.no_grad():
        model_logits(model, batch(target))
    config = model.config
    renorm = family == "mixtral" or config.norm_topk_prob
    router = {i: model.model.layers[i].mlp.gate for i in range(L)}
    hidden = {}
    for i in range(L):
        router[i].register_forward_hook(lambda m, a, o, i=i: hidden.__setitem__(i, a[0]))
    with torch.no_grad():
        model_logits(model, batch(target))
    for layer, idx, weights in seen.calls:
        want = target[:, :, layer].reshape(-1, K).long()
        want[2] = own[0, 2, layer].long()  # row 0, column 2: not recorded
        assert torch.equal(idx, want)
        probs = torch.softmax(torch.nn.functional.linear(hidden[layer].reshape(-1, 32), router[layer].weight), -1)
        w = probs.gather(1, want)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.float(), w)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replaying_the_routers_own_choice_changes_nothing(family):
    model = install(tiny(family), "R3")
    with torch.no_grad():
        plain, _ = model_logits(model, batch())
        own = native_routing(model, batch())
        replayed, _ = model_logits(model, batch(own))
    assert torch.equal(plain, replayed)
    stats = replay_of(model).take_stats()
    assert stats["routing_tokens"] == 11 and stats["routing_differ_sum"] == 0  # 4 x 3 response tokens, 1 padding


@pytest.mark.parametrize("path", ["packed", "shared"])
def test_the_targets_follow_the_packed_and_shared_prompt_forwards(path):
    model = install(tiny("qwen2_moe"), "R3")
    target = shifted(native_routing(model, batch()))
    with torch.no_grad():
        plain = torch.nn.functional.log_softmax(model_logits(model, batch(target))[0][:, -4:-1], -1)
        other, offset = model_logits(model, batch(target), packed=path == "packed", shared=path == "shared")
    got = torch.nn.functional.log_softmax(other[:, offset : offset + 3], -1)
    real = batch().action_mask
    torch.testing.assert_close(got[real], plain[real], atol=1e-5, rtol=1e-5)
    stats = replay_of(model).take_stats()
    assert stats["routing_differ_sum"] == stats["routing_tokens"] > 0  # every token's experts were moved


def test_the_router_gets_its_gradient_and_a_checkpoint_recompute_routes_as_the_forward():
    torch.manual_seed(0)
    grads = {}
    for checkpointing in (False, True):
        model = install(tiny("mixtral"), "R3").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        target = shifted(native_routing(model, batch()))
        logits, _ = model_logits(model, batch(target))
        logits[:, -4:-1].logsumexp(-1).sum().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gate = "model.layers.0.mlp.gate.weight"
    assert grads[False][gate].abs().sum() > 0
    for name, g in grads[False].items():  # the recompute used the same experts: the same gradients
        torch.testing.assert_close(grads[True][name], g, atol=1e-5, rtol=1e-4)


def test_r2_records_the_routers_own_choice_in_the_batch_layout():
    model = install(tiny("qwen3_moe"), "R2")
    replay = replay_of(model)
    own = native_routing(model, batch())
    with torch.no_grad(), replay.recording_into(batch()) as slotted:
        model_logits(model, slotted, shared=True)  # the shared-prompt passes record too
    rec = replay.recorded
    real = batch().attention_mask.bool()
    real[:, -1] = False  # the shared-prompt forward never runs the last column (its output would score nothing)
    assert torch.equal(rec[real], own[real])  # rows 1 and 3 too, whose prompts ran once, in rows 0 and 2
    assert (rec[:, -1] == -1).all()


def test_no_replay_without_recorded_experts_and_dense_families_are_refused():
    model = install(tiny("qwen2_moe"), "R3")
    with torch.no_grad(), routed(model, batch()):  # routing None: nothing to follow
        assert replay_of(model)._now is None
    dense = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="llama is not a mixture-of-experts family"):
        RouterReplay(dense, "R3")


# ---- the flag's rules, the family check, the experts' way from the engine to the batch --------------------------


def config_problems(**flags) -> list[str]:
    from orlhf.config.flags import build_config
    from orlhf.config.train_config import ConfigError

    try:
        build_config({"device": "cpu", **flags}, explicit=set(flags))
    except ConfigError as e:
        return e.problems
    return []


@pytest.mark.parametrize(
    "flags, fragments",
    [
        ({"router_replay": "R3", "vllm_num_engines": 0}, ["--router_replay R3", "--vllm_num_engines 0", "R2"]),
        ({"router_replay": "R3", "enable_prefix_caching": True}, ["--enable_prefix_caching on CPU"]),
        ({"router_replay": "R3", "device": "cuda"}, ["on GPUs", "add --enable_prefix_caching"]),
        ({"router_replay": "R2", "init_kl_coef": 0.0}, ["--router_replay R2", "first and only", "Drop it"]),
    ],
)
def test_the_flag_is_refused_by_name_where_it_cannot_apply(flags, fragments):
    found = config_problems(**flags)
    assert any(all(f in p for f in fragments) for p in found), found


def test_the_flag_is_accepted_where_it_applies():
    assert config_problems(router_replay="R3") == []
    assert config_problems(router_replay="R3", device="cuda", enable_prefix_caching=True) == []
    assert config_problems(router_replay="R2", vllm_num_engines=0, max_epochs=2) == []  # the actor samples: R2


def test_a_dense_actor_is_refused_by_name_before_ray_starts(tmp_path):
    import dataclasses
    import json

    from orlhf.config.flags import build_config
    from orlhf.config.train_config import ConfigError
    from orlhf.launch.preflight import check_replayed_family

    base = build_config({"device": "cpu", "router_replay": "R3"}, explicit=set())

    def cfg(model_type):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        return dataclasses.replace(base, data=dataclasses.replace(base.data, pretrain=str(folder)))

    with pytest.raises(ConfigError, match=r"--router_replay R3 .* \(llama\) is not of a family orlhf replays"):
        check_replayed_family(cfg("llama"))
    for family in FAMILIES:
        check_replayed_family(cfg(family))


def rollout(prompt, response, routed):
    from orlhf.types import Rollout

    return Rollout(0, prompt, response, [0.0] * len(response), True, routed_experts=routed)


def rows(n, start=0):
    """(n, L, K) rows whose values say their position: row i holds start + i everywhere."""
    return (torch.arange(start, start + n, dtype=torch.int16).view(n, 1, 1)).expand(n, L, K).clone()


def test_the_engines_experts_land_at_their_tokens_columns():
    from orlhf.trainer.experience import rollouts_to_batch

    # prompts of 3 and 2 tokens (left-padded to 3), responses of 2 and 4: P = 3, A = 4, T = 7
    a = rollout([5, 6, 7], [8, 9], rows(4))  # P + R - 1 = 4 positions: the last sampled token never ran
    b = rollout([5, 6], [8, 9, 10, 11], None)  # an engine without a record
    batch, _ = rollouts_to_batch([a, b], 0)
    assert batch.routing.shape == (2, 7, L, K)
    assert batch.routing[0, :, 0, 0].tolist() == [0, 1, 2, 3, -1, -1, -1]
    assert (batch.routing[1] == -1).all()
    assert rollouts_to_batch([rollout([5], [6], None)], 0)[0].routing is None  # off: nothing at all


def test_continued_samples_and_agent_turns_keep_the_experts_their_tokens_were_sampled_under():
    from orlhf.rollout.partial import grow_routing, merge_routing

    first, later = rows(5), rows(9, start=100)  # a continuation ran all 9 positions again, under new weights
    merged = merge_routing(first, later)
    assert merged[:, 0, 0].tolist() == [0, 1, 2, 3, 4, 105, 106, 107, 108]
    assert merge_routing(None, later) is later and merge_routing(first, None) is first
    # agents: a turn re-read tokens [1, 2, 3]; a custom executor then rewrote token 3: its row and after are gone
    ids, held = grow_routing([1, 2, 3, 4], rows(3), [1, 2, 3, 4, 5, 6], rows(5, start=100))
    assert ids == [1, 2, 3, 4, 5, 6] and held[:, 0, 0].tolist() == [0, 1, 2, 103, 104]
    _, cut = grow_routing(ids, held, [1, 2, 9, 4, 5, 6], None)
    assert cut[:, 0, 0].tolist() == [0, 1]


def test_the_cpu_capture_puts_each_steps_rows_at_each_requests_positions():
    import numpy as np

    from orlhf.cpu.routing_capture import RoutingStore, _take

    store = RoutingStore(layers=L, top_k=K)
    # step 1: request "a-x" prefills 3 tokens, "b-y" 2; the forward pads to 6 rows
    store.begin_step(5)
    for layer in range(L):
        store.capture(layer, torch.arange(6).view(6, 1).expand(6, K) + 10 * layer)
    store.end_step(["a-x", "b-y"], [3, 2], np.array([0, 1, 2, 0, 1]))
    # step 2: one decode token each, b first in the batch now
    store.begin_step(2)
    for layer in range(L):
        store.capture(layer, torch.tensor([[7, 7], [8, 8]]))
    store.end_step(["b-y", "a-x"], [1, 1], np.array([2, 3]))
    a = store.rows["a-x"]
    assert a[:4, 0, 0].tolist() == [0, 1, 2, 8] and a[:4, 1, 0].tolist() == [10, 11, 12, 8]
    assert store.rows["b-y"][:3, 0, 0].tolist() == [3, 4, 7]

    class Out:  # vLLM's RequestOutput / CompletionOutput, as far as _take reads them
        prompt_token_ids = [1, 2, 3]

    class Completion:
        token_ids = [4, 5]

    got = _take(store, "a", 0, False, Out, Completion)  # external id "a" -> internal "a-x"; 3 + 2 - 1 rows
    assert got.shape == (4, L, K) and "a-x" not in store.rows
