"""A LoRA actor on real process groups (gloo, two ranks, no Ray), ZeRO-2 and ZeRO-3: its optimizer steps equal a
plain peft model stepped by torch's AdamW on the whole batch, and its adapter-off log-probs equal a separate frozen
ReferenceWorker's on the same folder (the reference a LoRA run scores without a second copy of the model); a new
actor that loads the checkpoint saved after step 1 makes step 2 bit-equal to the uninterrupted one (LoRA's resume).

Each rank runs two PPO steps with ratio 1 (no old log-probs: the single-pass path), so the loss is the token mean of
-advantage * log pi over the global batch, and writes the adapter before and after, and both log-probs. The parent
replays the same two steps on one plain peft model: loss, backward, clip at --max_norm, AdamW.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import save_tiny_llama, spawn_ranks

from orlhf.types import Experience

B, P, A, V, LR = 8, 6, 5, 128, 1e-2


def _experience() -> Experience:
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, V, (B, P + A), generator=g)
    ones = torch.ones_like(seqs)
    return Experience(seqs, ones, ones[:, P:].bool(), action_log_probs=None, advantages=torch.randn(B, A, generator=g))


def _rank_main(rank: int, world: int, port: int, path: str, stage: int, out: str) -> None:
    from orlhf.config.worker_config import role_config
    from orlhf.config.worker_slices import LoraSlice
    from orlhf.workers import PolicyWorker, ReferenceWorker

    common = dict(model_path=path, device="cpu", zero_stage=stage, micro_forward_batch_size=4)
    actor_cfg = role_config(
        "actor",
        **common,
        learning_rate=LR,
        train_batch_size=B,
        micro_train_batch_size=2,
        total_optimizer_steps=2,
        lr_scheduler="constant",  # the plain AdamW below steps at a constant LR
        lora=LoraSlice(rank=4, alpha=8),
    )
    actor = PolicyWorker(actor_cfg)
    actor.init()
    ref = ReferenceWorker(role_config("ref", **common))
    ref.init()
    share = _experience().index(torch.arange(rank, B, world))  # this rank's rows
    before = actor.state_dict_full()
    ckpt = os.path.join(out, "ckpt")
    actor.train_step(share)
    actor.save_checkpoint(ckpt)  # the adapter and its Adam state after step 1
    actor.train_step(share)
    after = actor.state_dict_full()
    batch = share.as_sequence_batch()
    result = {"base": actor.base_log_probs(batch), "ref": ref.log_probs(batch), "rows": list(range(rank, B, world))}
    resumed = PolicyWorker(actor_cfg)  # a new process's actor: the base weights from the folder, then the checkpoint
    resumed.init()
    resumed.load_checkpoint(ckpt)
    resumed.train_step(share)
    resumed = resumed.state_dict_full()
    if rank == 0:
        result.update(before=before, after=after, resumed=resumed)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("lora_mp"), V))


def _plain_peft_steps(path: str, start: dict) -> dict:
    """The same two steps on one peft model over the whole batch: token-mean -A * log pi, clip 1.0, AdamW."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules="all-linear", bias="none"),
    )
    model.load_state_dict({k: v for k, v in start.items() if ".lora_" in k}, strict=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    exp = _experience()
    for _ in range(2):
        logits = model(input_ids=exp.sequences).logits[:, P - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, exp.sequences[:, P:, None]).squeeze(-1)  # (B, A)
        loss = -(exp.advantages * logp).sum() / logp.numel()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items() if ".lora_" in k}


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_steps_equal_plain_peft_adamw_and_adapter_off_is_the_reference(model_path, tmp_path, stage):
    spawn_ranks(_rank_main, 2, model_path, stage, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    lora_keys = [k for k in r0["after"] if ".lora_" in k]
    assert lora_keys and all(".lora_A." in k or ".lora_B." in k for k in lora_keys)
    expected = _plain_peft_steps(model_path, r0["before"])
    moved = max((r0["after"][k] - r0["before"][k]).abs().max().item() for k in lora_keys)
    diff = max((r0["after"][k] - expected[k]).abs().max().item() for k in lora_keys)
    print(f"\n[ZeRO-{stage}] adapter moved {moved:.2e}; LoRA worker - plain peft AdamW {diff:.2e}")
    assert moved > 5e-3  # two Adam steps of lr 1e-2: A moves on the second (B starts at zero)
    assert diff < 1e-5
    frozen = [k for k in r0["after"] if ".lora_" not in k]
    assert all(torch.equal(r0["after"][k], r0["before"][k]) for k in frozen)  # the base weights never move
    for r in (r0, r1):  # adapter off == a separate frozen reference, on every rank's rows
        assert (r["base"] - r["ref"]).abs().max().item() < 1e-5
    # step 2 from step 1's checkpoint, in a fresh actor, equals the uninterrupted step 2 bit for bit
    assert r0["resumed"].keys() == r0["after"].keys()
    assert all(torch.equal(r0["resumed"][k], r0["after"][k]) for k in r0["after"])
