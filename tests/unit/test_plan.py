"""Flags -> layout (pure), the pre-flight fit check, the memory estimate and `orlhf plan`. No Ray here."""

import json
from collections import defaultdict

import pytest

from orlhf.cli import main
from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.distributed.layout import PlacementError, Slot, check_fits, cpu_slots_needed, described_nodes, simulate
from orlhf.launch.bringup import run_layout
from orlhf.launch.plan_memory import (
    GIB,
    ModelDims,
    count_lora_params,
    count_params,
    device_peak,
    read_dims,
    role_memory,
)

# Llama-3-70B's shape (hand count below).
CONFIG_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# head_dim = 8192/64 = 128, kv width = 8 x 128 = 1024. Per layer: q, o 2 x 8192^2 = 134,217,728;
# k, v 2 x 8192 x 1024 = 16,777,216; MLP 3 x 8192 x 28672 = 704,643,072; norms 2 x 8192 = 16,384
# -> 855,654,400; x 80 layers = 68,452,352,000. Embeddings 128256 x 8192 = 1,050,673,152, LM head the same,
# final norm 8,192 -> 70,553,706,496. Value-head model (critic, reward): minus the LM head, plus 8192 -> 69,503,041,536.
P_LM, P_VALUE = 70_553_706_496, 69_503_041_536


def cfg_of(**flags):
    return build_config(flags, explicit=set(flags))


@pytest.fixture
def model70b(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CONFIG_70B))
    (tmp_path / "prompts.jsonl").write_text('{"input": "hi"}\n')
    return tmp_path


def layout_of(cfg, device: str):
    """plan_layout on `device`, as a finished config (or `orlhf plan` for a described cluster) carries it."""
    return run_layout(resolve_device(cfg, device))


def tiny_rm(tmp_path):
    (tmp_path / "rm").mkdir(exist_ok=True)
    (tmp_path / "rm" / "config.json").write_text(
        json.dumps(
            {
                **CONFIG_70B,
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 100,
            }
        )
    )
    return str(tmp_path / "rm")


def shares_per_slot(layout):
    """Share asked per slot by the processes on it (a guest role has no process: it asks for nothing)."""
    total = defaultdict(float)
    owners = [slots for role, slots in layout.roles.items() if role not in layout.guests]
    for slots in owners + list(layout.engines):
        for s in slots:
            total[(s.pool, s.group, s.bundle)] += s.share
    return total


# ---- plan_layout -------------------------------------------------------------------------------------------


def test_split_layout_one_pool_per_role_and_per_engine():
    cfg = cfg_of(
        actor_num_nodes=2,
        actor_num_gpus_per_node=2,
        ref_num_gpus_per_node=2,
        critic_num_gpus_per_node=2,
        vllm_num_engines=2,
        vllm_tensor_parallel_size=2,
    )
    layout = layout_of(cfg, "cuda")
    assert [(p.name, p.num_groups, p.group_size) for p in layout.pools] == [
        ("actor", 2, 2),
        ("ref", 1, 2),
        ("critic", 1, 2),
        ("vllm0", 1, 2),
        ("vllm1", 1, 2),
    ]
    # rank r -> node-group r // 2, bundle r % 2
    assert layout.roles["actor"] == (
        Slot("actor", 0, 0, 1.0),
        Slot("actor", 0, 1, 1.0),
        Slot("actor", 1, 0, 1.0),
        Slot("actor", 1, 1, 1.0),
    )
    assert layout.engines[1] == (Slot("vllm1", 0, 0, 1.0), Slot("vllm1", 0, 1, 1.0))
    assert "reward" not in layout.roles  # no --reward_pretrain
    assert layout.bundle == {"GPU": 1.0, "CPU": 1.0}
    assert layout_of(cfg, "cpu").bundle == {"CPU": 1.0}
    assert cpu_slots_needed(layout) == 4 + 2 + 2 + 2 * 2


def test_no_critic_without_gae():
    layout = layout_of(cfg_of(advantage_estimator="reinforce"), "cpu")
    assert list(layout.roles) == ["actor", "ref"]


def test_no_reference_model_without_a_kl():
    # --init_kl_coef 0 without --use_kl_loss: no KL anywhere, so no ref group (OpenRLHF's rule)
    own = dict(critic_own_process=True)  # the critic's pool of its own (else in the actor's process on CPU)
    layout = layout_of(cfg_of(init_kl_coef=0.0, **own), "cpu")
    assert list(layout.roles) == ["actor", "critic"] and [p.name for p in layout.pools] == ["actor", "critic", "vllm0"]
    # --colocate_actor_ref then has nothing to colocate; under --colocate_all_models the ref takes no share
    assert [p.name for p in layout_of(cfg_of(init_kl_coef=0.0, colocate_actor_ref=True, **own), "cpu").pools] == [
        "actor",
        "critic",
        "vllm0",
    ]
    shared = layout_of(cfg_of(init_kl_coef=0.0, colocate_all_models=True, **own), "cpu")
    assert [p.name for p in shared.pools] == ["actor+critic+vllm"] and shared.roles["actor"][0].share == 0.33
    # a KL in the loss reads the reference even at coefficient 0
    assert list(layout_of(cfg_of(init_kl_coef=0.0, use_kl_loss=True), "cpu").roles) == ["actor", "ref", "critic"]


def test_colocate_actor_ref_shares_one_pool():
    cfg = cfg_of(actor_num_gpus_per_node=4, ref_num_gpus_per_node=4, colocate_actor_ref=True)
    layout = layout_of(cfg, "cuda")
    assert [p.name for p in layout.pools] == ["actor+ref", "critic", "vllm0"]
    assert layout.roles["ref"] == tuple(Slot("actor+ref", 0, b, 0.5) for b in range(4))
    assert layout.roles["actor"][3] == Slot("actor+ref", 0, 3, 0.5)
    assert layout.roles["critic"] == (Slot("critic", 0, 0, 1.0),)


def test_colocate_critic_reward_shares_one_pool(tmp_path):
    cfg = cfg_of(reward_pretrain=tiny_rm(tmp_path), critic_num_nodes=2, reward_num_nodes=2, colocate_critic_reward=True)
    layout = layout_of(cfg, "cuda")
    assert [p.name for p in layout.pools] == ["actor", "ref", "critic+reward", "vllm0"]
    assert layout.roles["reward"] == (Slot("critic+reward", 0, 0, 0.5), Slot("critic+reward", 1, 0, 0.5))


def test_async_colocate_all_models_shares_the_actor_pool_among_models_only():
    cfg = cfg_of(colocate_all_models=True, async_train=True, vllm_num_engines=2)
    layout = layout_of(cfg, "cuda")
    assert [p.name for p in layout.pools] == ["actor+ref+critic", "vllm0", "vllm1"]
    assert layout.roles["critic"] == (Slot("actor+ref+critic", 0, 0, 0.33),)
    assert layout.engines[1] == (Slot("vllm1", 0, 0, 1.0),)


def test_colocate_all_models_puts_engines_on_the_actor_pool(tmp_path):
    shape = {
        f"{r}_{k}": v
        for r in ("actor", "ref", "critic", "reward")
        for k, v in (("num_nodes", 2), ("num_gpus_per_node", 4))
    }
    cfg = cfg_of(
        reward_pretrain=tiny_rm(tmp_path),
        colocate_all_models=True,
        vllm_num_engines=4,
        vllm_tensor_parallel_size=2,
        micro_train_batch_size=8,
        **shape,
    )
    layout = layout_of(cfg, "cuda")
    assert [(p.name, p.num_groups, p.group_size) for p in layout.pools] == [("actor+ref+critic+reward+vllm", 2, 4)]
    pool = "actor+ref+critic+reward+vllm"
    # 5 occupants per slot -> 0.2 each; engine i on slots [2i, 2i+2): engine 1 -> g0 b2,b3; engine 2 -> g1 b0,b1
    assert layout.engines[1] == (Slot(pool, 0, 2, 0.2), Slot(pool, 0, 3, 0.2))
    assert layout.engines[2] == (Slot(pool, 1, 0, 0.2), Slot(pool, 1, 1, 0.2))
    assert all(s.share == 0.2 for s in layout.roles["reward"])
    totals = shares_per_slot(layout)
    assert len(totals) == 8 and all(t == pytest.approx(1.0) for t in totals.values())


def test_shares_never_exceed_one_slot():
    cfg = cfg_of(colocate_all_models=True, advantage_estimator="reinforce", ref_own_process=True)
    totals = shares_per_slot(layout_of(cfg, "cpu"))  # actor, ref, vllm -> 0.33 each
    assert list(totals.values()) == [pytest.approx(0.99)]  # 3 x floor(100/3)/100 = 0.99 <= 1
    hosted = layout_of(cfg_of(colocate_all_models=True, advantage_estimator="reinforce"), "cpu")
    assert list(shares_per_slot(hosted).values()) == [1.0]  # the ref in the actor's process: actor, vllm 0.5 each


def test_cpu_reference_runs_in_the_actors_processes_without_bundles():
    grpo = dict(advantage_estimator="group_norm", n_samples_per_prompt=4, use_kl_loss=True)
    layout = layout_of(cfg_of(**grpo), "cpu")
    assert layout.guests == {"ref": "actor"}
    assert [p.name for p in layout.pools] == ["actor+ref", "vllm0"]
    assert layout.roles["ref"] == layout.roles["actor"] == (Slot("actor+ref", 0, 0, 1.0),)
    assert cpu_slots_needed(layout) == 2  # actor + engine: the ref reserves no logical CPU
    own = layout_of(cfg_of(ref_own_process=True, **grpo), "cpu")
    assert own.guests == {} and [p.name for p in own.pools] == ["actor", "ref", "vllm0"]
    assert cpu_slots_needed(own) == 3
    # not hosted: on GPUs (each rank owns its device), or with a rank count unlike the actor's
    assert layout_of(cfg_of(**grpo), "cuda").guests == {}
    assert layout_of(cfg_of(actor_num_gpus_per_node=2, micro_train_batch_size=8, **grpo), "cpu").guests == {}
    assert layout_of(cfg_of(advantage_estimator="reinforce", init_kl_coef=0.0), "cpu").guests == {}  # no ref


def test_cpu_one_rank_critic_runs_in_the_actors_process_beside_it(tmp_path):
    from orlhf.cpu.hosting_rules import has_dropout, runs_beside

    layout = layout_of(cfg_of(), "cpu")  # the demo's GAE: actor + hosted ref + critic, one rank each
    assert layout.guests == {"ref": "actor", "critic": "actor"}
    assert [p.name for p in layout.pools] == ["actor+ref+critic", "vllm0"] and cpu_slots_needed(layout) == 2
    assert runs_beside(resolve_device(cfg_of(), "cpu"), "critic")
    assert not runs_beside(resolve_device(cfg_of(), "cpu"), "ref")  # the ref's calls take their turn
    # apart: asked for, on GPUs, with more ranks on either side, or colocated with a reward model
    assert layout_of(cfg_of(critic_own_process=True), "cpu").guests == {"ref": "actor"}
    assert layout_of(cfg_of(), "cuda").guests == {}
    assert "critic" not in layout_of(cfg_of(critic_num_gpus_per_node=2, micro_train_batch_size=8), "cpu").guests
    assert "critic" not in layout_of(cfg_of(actor_num_gpus_per_node=2, micro_train_batch_size=8), "cpu").guests
    # a critic model with dropout: concurrent train steps would interleave draws from one random generator
    for name, config in (
        ("llama", {"attention_dropout": 0.0}),
        ("gpt2", {"resid_pdrop": 0.1, "attn_pdrop": 0.1}),
        ("bert", {"hidden_dropout_prob": 0.1}),
        ("nested", {"text_config": {"dropout": 0.1}}),
        ("none", None),
    ):
        (tmp_path / name).mkdir()
        if config is not None:
            (tmp_path / name / "config.json").write_text(json.dumps({"model_type": name, **config}))
    assert [has_dropout(str(tmp_path / n)) for n in ("llama", "gpt2", "bert", "nested", "none")] == [
        False,
        True,
        True,
        True,
        True,
    ]
    assert has_dropout(None) is False  # the built-in demo before its path is resolved: attention_dropout 0


# ---- pre-flight ----------------------------------------------------------------------------------------------


def test_first_fit_places_node_groups_whole():
    cfg = cfg_of(
        actor_num_gpus_per_node=4,
        ref_num_gpus_per_node=2,
        critic_num_gpus_per_node=2,
        vllm_num_engines=2,
        vllm_tensor_parallel_size=2,
    )
    layout = layout_of(cfg, "cuda")
    placed = check_fits(layout, described_nodes(3, 4, "cuda"))
    assert placed[("actor", 0)] == 0  # largest first, first node with room
    per_node = defaultdict(int)
    for key, node in placed.items():
        per_node[node] += layout.pool(key[0]).group_size
    assert dict(per_node) == {0: 4, 1: 4, 2: 4}  # actor 4 | ref 2 + critic 2 | two TP-2 engines


def test_preflight_rejects_impossible_layout_with_a_table_and_the_fix():
    layout = layout_of(cfg_of(actor_num_gpus_per_node=8, micro_train_batch_size=8), "cuda")
    with pytest.raises(PlacementError) as err:
        check_fits(layout, described_nodes(2, 4, "cuda"))
    msg = str(err.value)
    assert "1 of 4 node-group(s) found no node" in msg
    assert "GPU need/free/total" in msg and "node0" in msg and "node1" in msg
    assert "actor g0: needs 8 GPU + 8 CPU on one node" in msg
    assert "--actor_num_gpus_per_node 8" in msg and "raise --actor_num_nodes" in msg


def test_preflight_names_tp_when_an_engine_exceeds_every_node():
    layout = layout_of(cfg_of(vllm_tensor_parallel_size=8), "cuda")
    with pytest.raises(PlacementError, match="lower --vllm_tensor_parallel_size to at most 4"):
        check_fits(layout, described_nodes(4, 4, "cuda"))


def test_preflight_too_few_devices_in_all():
    layout = layout_of(cfg_of(actor_num_nodes=2, actor_num_gpus_per_node=2, vllm_num_engines=3), "cpu")
    with pytest.raises(PlacementError) as err:  # 4 + 1 + 1 + 3 = 9 CPU slots on 2 x 4
        check_fits(layout, described_nodes(2, 4, "cpu"))
    assert "needs 9 CPUs in all, the cluster has 8: add nodes" in str(err.value)
    assert simulate(layout, described_nodes(3, 4, "cpu"))[1] == []


# ---- memory estimate -----------------------------------------------------------------------------------------


def test_param_count_70b(model70b):
    dims = read_dims(model70b / "m")
    assert count_params(dims) == P_LM
    assert count_params(dims, value_head=True) == P_VALUE
    assert count_params(ModelDims("x", 8, 1, 16, 10, 2, 2, 4, tied=True)) == 10 * 8 + (4 * 64 + 3 * 128 + 16) + 8


def test_memory_70b_layout(model70b):
    cfg = cfg_of(
        pretrain=str(model70b / "m"),
        reward_pretrain=str(model70b / "m"),
        prompt_data=str(model70b / "prompts.jsonl"),
        bf16=True,
    )
    # bf16 ZeRO-3 trained: (2 + 2 + 12) P / N. actor N=16: 16 x 70,553,706,496 / 16 B = 65.71 GiB
    actor = role_memory(cfg, "actor", P_LM, 16, device="cpu")
    assert actor.device_gib == pytest.approx(P_LM / GIB) and round(actor.device_gib, 1) == 65.7
    assert round(role_memory(cfg, "critic", P_VALUE, 16, device="cpu").device_gib, 1) == 64.7  # 69,503,041,536 B
    # on GPUs + DeepSpeed's reduce bucket, 5e8 bf16 elements = 1,000,000,000 B = 0.93 GiB per trained rank
    gpu = role_memory(cfg, "actor", P_LM, 16, device="cuda")
    assert gpu.device_gib == pytest.approx((P_LM + 1e9) / GIB) and "reduce bucket" in gpu.formula
    # frozen: 2 P / 8 = 17,638,426,624 B = 16.43 GiB (ref); 17,375,760,384 B = 16.18 GiB (reward); no bucket
    assert round(role_memory(cfg, "ref", P_LM, 8, device="cuda").device_gib, 1) == 16.4
    assert round(role_memory(cfg, "reward", P_VALUE, 8, device="cuda").device_gib, 1) == 16.2


@pytest.mark.parametrize(
    "flags, device_gib, host_gib",
    [
        ({"zero_stage": 0}, 16, 0),  # 2 + 2 + 12, nothing sharded
        ({"zero_stage": 1}, 7, 0),  # 2 + 2 + 12/4
        ({"zero_stage": 2}, 5.5, 0),  # 2 + (2 + 12)/4
        ({"zero_stage": 3}, 4, 0),  # (2 + 2 + 12)/4
        ({"zero_stage": 3, "adam_offload": True}, 1, 3),  # Adam 12/4 to host
    ],
)
def test_trained_memory_by_zero_stage(flags, device_gib, host_gib):
    m = role_memory(cfg_of(bf16=True, **flags), "actor", GIB, 4, device="cpu")  # P = 2**30 params: bytes/param == GiB
    assert (m.device_gib, m.host_gib) == (pytest.approx(device_gib), pytest.approx(host_gib))


@pytest.mark.parametrize("stage, bucket_bytes", [(0, 0), (1, 4), (2, 2), (3, 2)])  # bf16 gradients; ZeRO-1: fp32
def test_trained_gpu_ranks_add_the_reduce_bucket_of_their_stage(stage, bucket_bytes):
    cpu = role_memory(cfg_of(bf16=True, zero_stage=stage), "actor", GIB, 1, device="cpu")
    gpu = role_memory(cfg_of(bf16=True, zero_stage=stage), "actor", GIB, 1, device="cuda")
    assert gpu.device_gib - cpu.device_gib == pytest.approx(bucket_bytes * 5e8 / GIB)
    assert ("reduce bucket" in gpu.formula) == (bucket_bytes > 0)
    default = role_memory(cfg_of(bf16=True), "actor", GIB, 1, device="cuda")  # one rank in bf16: ZeRO-2 by default
    assert default.device_gib == pytest.approx(
        role_memory(cfg_of(bf16=True, zero_stage=2), "actor", GIB, 1, device="cuda").device_gib
    )


def test_frozen_and_fp32_memory():
    assert (
        role_memory(cfg_of(zero_stage=2), "ref", GIB, 4, device="cpu").device_gib == 4
    )  # fp32, replicated below stage 3
    assert role_memory(cfg_of(), "actor", GIB, 4, device="cpu").device_gib == 4  # fp32 stage 3: (4 + 4 + 8)/4
    m = role_memory(cfg_of(bf16=True, ref_reward_offload=True), "reward", GIB, 4, device="cpu")
    assert (m.device_gib, m.host_gib) == (0, 0.5)


def test_device_peak_with_sleep():
    cfg = cfg_of(colocate_all_models=True, vllm_enable_sleep=True, deepspeed_enable_sleep=True)
    assert device_peak(cfg, trainers=30, engine=40) == 40  # max(generation 40, training 30)
    assert device_peak(cfg_of(), trainers=30, engine=40) == 70  # no sleep: both resident
    assert device_peak(cfg_of(), trainers=30, engine=0) == 30


# ---- orlhf plan --------------------------------------------------------------------------------------------

LAYOUT_70B = [
    "--actor_num_nodes",
    "2",
    "--actor_num_gpus_per_node",
    "8",
    "--critic_num_nodes",
    "2",
    "--critic_num_gpus_per_node",
    "8",
    "--ref_num_gpus_per_node",
    "8",
    "--reward_num_gpus_per_node",
    "8",
    "--vllm_num_engines",
    "4",
    "--vllm_tensor_parallel_size",
    "4",
    "--bf16",
    "--micro_train_batch_size",
    "4",
]


def plan(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *argv])
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


def model_flags(root):
    return [
        "--pretrain",
        str(root / "m"),
        "--reward_pretrain",
        str(root / "m"),
        "--prompt_data",
        str(root / "prompts.jsonl"),
    ]


def test_plan_70b_on_described_cluster(model70b, capsys):
    code, out, err = plan(
        [*model_flags(model70b), *LAYOUT_70B, "--nodes", "8", "--gpus_per_node", "8", "--gpu_memory_gb", "80"], capsys
    )
    assert code == 0, out + err
    assert "described: 8 nodes x 8 GPU x 80 GiB" in out and "model: 70.6B params" in out
    lines = out[: out.index("memory estimate")].splitlines()
    assert "actor   16 (2x8)  actor   g0          node0  0-7      1" in lines
    # engines: two TP-4 engines per 8-GPU node, each whole on one node (nodes 0-5 hold the four models)
    assert [ln.split()[5] for ln in lines if ln.startswith("vllm") and "TP 4" in ln] == ["node6"] * 2 + ["node7"] * 2
    table = out[out.index("memory estimate") :]
    # GPUs: trained ranks add DeepSpeed's reduce bucket (1e9 B = 0.93 GiB): actor 65.7 -> 66.6, critic 64.7 -> 65.7
    for who, gib in (("actor", "66.6"), ("ref", "16.4"), ("critic", "65.7"), ("reward", "16.2"), ("vllm", "72.0")):
        assert any(ln.startswith(who) and f" {gib} " in ln for ln in table.splitlines()), who
    assert "weights 2P/4 = 32.9" in out  # 2 x 70,553,706,496 / 4 B = 32.85 GiB within 0.9 x 80 = 72
    assert "OK: every node-group is placed" in out


def test_plan_flags_memory_that_does_not_fit(model70b, capsys):
    argv = [
        *model_flags(model70b),
        *LAYOUT_70B,
        "--actor_num_nodes",
        "1",
        "--nodes",
        "8",
        "--gpus_per_node",
        "8",
        "--gpu_memory_gb",
        "80",
    ]
    code, out, _ = plan(argv, capsys)
    assert code == 1
    # actor on 8 ranks: 16 x 70,553,706,496 / 8 B + 1e9 B reduce bucket = 132.3 GiB per GPU > 80
    assert any(ln.startswith("actor ") and "132.3" in ln and "NOT FIT" in ln for ln in out.splitlines())
    assert "DOES NOT FIT: actor needs 132.3 GiB per GPU, more than 80" in out


def test_plan_flags_what_cannot_be_placed(model70b, capsys):
    code, out, _ = plan(
        [*model_flags(model70b), *LAYOUT_70B, "--nodes", "4", "--gpus_per_node", "8", "--gpu_memory_gb", "80"], capsys
    )
    assert code == 1
    assert "NOT PLACED" in out and "needs 64 GPUs in all, the cluster has 32: add nodes" in out
    # first fit: the four 8-GPU node-groups of actor and critic fill the 4 nodes; ref, reward, 4 engines are left
    assert "DOES NOT FIT: 6 node-group(s) cannot be placed" in out


def test_plan_on_this_machine_cpu(capsys):
    code, out, _ = plan(["--device", "cpu", "--colocate_all_models", "--vllm_num_engines", "1"], capsys)
    assert code == 0, out
    # the ref and the critic run in the actor's process: 2 processes share the slot (actor, vllm), 0.5 each
    assert "this machine" in out and "actor+ref+critic+vllm" in out and "0.5" in out and "0.33" not in out
    assert "ref runs inside the actor's rank processes" in out and "--ref_own_process gives it its own" in out
    assert "critic runs inside the actor's rank processes" in out and "--critic_own_process gives" in out
    code, out, _ = plan(
        ["--device", "cpu", "--colocate_all_models", "--vllm_num_engines", "1", "--critic_own_process"], capsys
    )
    assert code == 0 and "0.33" in out and "critic runs inside" not in out  # actor (+ ref), critic, vllm
    code, out, _ = plan(
        [
            "--device",
            "cpu",
            "--colocate_all_models",
            "--vllm_num_engines",
            "1",
            "--ref_own_process",
            "--critic_own_process",
        ],
        capsys,
    )
    assert code == 0 and "0.25" in out and "runs inside" not in out


def test_plan_without_a_kl_lists_no_reference(capsys):
    code, out, _ = plan(["--device", "cpu", "--init_kl_coef", "0"], capsys)
    assert code == 0, out
    assert not any(ln.startswith("ref") for ln in out.splitlines()), out
    assert any(ln.startswith("actor") for ln in out.splitlines())


def test_plan_needs_both_cluster_flags(capsys):
    code, _, err = plan(["--nodes", "2"], capsys)
    assert code == 2 and "--gpus_per_node" in err


def test_lora_adapter_params_and_memory_70b(model70b):
    # all-linear, rank 16, per layer: q 16(8192 + 8192) + k, v 16(8192 + 1024) each + o 16(8192 + 8192)
    # + gate, up 16(8192 + 28672) each + down 16(28672 + 8192) = 262,144 + 294,912 + 262,144 + 1,769,472
    # = 2,588,672; x 80 layers = 207,093,760
    dims = read_dims(model70b / "m")
    assert count_lora_params(dims, 16, "all-linear") == 207_093_760
    assert count_lora_params(dims, 16, ("q_proj", "v_proj")) == 80 * (262_144 + 147_456)
    cfg = cfg_of(bf16=True, zero_stage=3, lora_rank=16)
    # ZeRO-3 over 16: weights 2(P + L), gradients 2L, Adam 12L, all / 16
    m = role_memory(cfg, "actor", P_LM, 16, device="cpu", adapter=207_093_760)
    assert m.device_gib == pytest.approx((2 * (P_LM + 207_093_760) + 14 * 207_093_760) / 16 / GIB)
    assert m.formula == "2(P + L)/16 + 2L/16 + 12L/16"


def test_plan_with_lora_places_no_reference_and_says_so(model70b, capsys):
    argv = [*model_flags(model70b), "--init_kl_coef", "0.01", "--nodes", "1", "--gpus_per_node", "8"]
    code, out, err = plan([*argv, "--lora_rank", "16", "--gpu_memory_gb", "141"], capsys)
    assert "LoRA rank 16 on all-linear: 207M params train; no reference model" in out, out + err
    assert not any(ln.startswith("ref ") for ln in out.splitlines())
    code, out, err = plan([*argv, "--gpu_memory_gb", "141"], capsys)
    assert any(ln.startswith("ref ") for ln in out.splitlines())


def test_plan_for_cuda_on_a_machine_without_one_says_what_to_do(capsys):
    code, out, err = plan(["--device", "cuda"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "--device cuda: this machine has no CUDA GPU to plan on. Describe the cluster (--nodes N" in err


def test_plan_validates_as_train_ppo_does_against_the_planned_device(capsys):
    """One validation, after the device is resolved: on this CPU machine the CUDA-only flags are refused as
    train-ppo refuses them; for a described GPU cluster they are fine."""
    flags = ["--vllm_sync_backend", "nccl", "--vllm_tensor_parallel_size", "2"]
    code, out, err = plan(flags, capsys)
    assert code == 2 and "--vllm_sync_backend nccl needs CUDA GPUs" in err and "--vllm_tensor_parallel_size" in err
    code, out, err = plan([*flags, "--nodes", "1", "--gpus_per_node", "8", "--gpu_memory_gb", "80"], capsys)
    assert code == 0, out + err


def test_a_model_plan_cannot_size_is_a_message_with_the_fix():
    """A hub id whose config.json the hub cannot give (offline here): ValueError, which `orlhf plan` prints as one
    line with exit 2 (validation catches a missing local folder before this)."""
    with pytest.raises(ValueError, match="no-such-org/no-such-model: no config.json to size it from .*huggingface-cli"):
        read_dims("no-such-org/no-such-model")
