"""The trainer side of a vision-language model on one DeepSpeed rank (gloo, no Ray), with the tiny Idefics3 demo
(orlhf/demo/vlm.py): loading through AutoModelForImageTextToText under ZeRO-3 (actor) and without ZeRO (reference),
image tensors passed with every forward, --freeze_visual_encoder, the weight-sync name list, checkpoint and export.

Two image prompts of different lengths (left padding), two samples each, one response shorter (right padding); the
forwards run two rows a micro-batch, sorted by length and trimmed, so a row whose images drifted from its ids
would score against another row's image. The reference numbers are a plain HF forward of each row alone."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from mp_tools import spawn_ranks

from orlhf.types import Experience, SequenceBatch, VisionRows

QUESTIONS = ("What colour is the shape?", "Colour?")  # prompts of 20 and 17 ids
A = 5  # response columns
CHUNK_MB = 488 * 4 * 2 / 2**20  # two tokens' float32 logits (the demo's 488-token vocabulary): chunked head path


def _prompts(model_dir: str, images: list[str]) -> list[tuple[torch.Tensor, dict]]:
    """(ids (P,), the processor's image tensors) per question, its image as the demo's rows give it."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    out = []
    for question, image in zip(QUESTIONS, images):
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(chat, add_generation_prompt=True)
        enc = processor(text=[text], images=[[Image.open(image)]], return_tensors="pt")
        out.append((enc.pop("input_ids")[0], {k: v for k, v in enc.items() if k != "attention_mask"}))
    return out


def _batch(prompts: list[tuple[torch.Tensor, dict]]) -> SequenceBatch:
    """Rows [q0, q1, q0, q1], left-padded prompts, a random response each (no image or layout ids), row 3's
    response two tokens short."""
    g = torch.Generator().manual_seed(0)
    p = max(len(ids) for ids, _ in prompts)
    rows, masks, vision = [], [], []
    for i in range(4):
        ids, tensors = prompts[i % 2]
        response = torch.randint(8, 488, (A,), generator=g)  # ids 0..7 are the special and image tokens
        pad = p - len(ids)
        rows.append(torch.cat([torch.full((pad,), 2), ids, response]))
        masks.append(torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(len(ids) + A, dtype=torch.long)]))
        vision.append(tensors)
    seqs, mask = torch.stack(rows), torch.stack(masks)
    mask[3, -2:] = 0
    seqs[3, -2:] = 2
    return SequenceBatch(seqs, mask, mask[:, p:].bool(), VisionRows(vision))


def _rank_main(rank: int, world: int, port: int, model_dir: str, batch: SequenceBatch, out: str) -> None:
    from dataclasses import replace

    from orlhf.config.worker_config import role_config
    from orlhf.workers import PolicyWorker, ReferenceWorker
    from orlhf.workers.lm_head import chunked_head

    common = dict(model_path=model_dir, device="cpu", vision=True, micro_forward_batch_size=2)
    actor = PolicyWorker(
        role_config(
            "actor",
            **common,
            zero_stage=3,
            freeze_visual_encoder=True,
            learning_rate=1e-2,
            train_batch_size=4,
            micro_train_batch_size=2,
            total_optimizer_steps=2,
            logprobs_chunk_mb=0.0,
        )
    )
    actor.init()
    r = {"log_probs": actor.log_probs(batch)}
    actor.cfg = replace(actor.cfg, logprobs_chunk_mb=CHUNK_MB)
    r["chunked_path"] = chunked_head(actor.engine, 2 * A, CHUNK_MB) is not None
    r["chunked"] = actor.log_probs(batch)
    r["frozen"] = [n for n, p in actor.module.named_parameters() if not p.requires_grad]
    r["trained_numel"] = sum(p.ds_numel for p in actor.module.parameters() if p.requires_grad)
    r["meta"] = [n for g in actor.weight_groups_meta() for n, _, _ in g]
    r["sync"] = [n for g in actor.sync_groups(to_cpu=True, copy=True) for n, _ in g]
    r["before"] = actor.state_dict_full()
    g = torch.Generator().manual_seed(1)
    exp = Experience(
        batch.sequences,
        batch.attention_mask,
        batch.action_mask,
        action_log_probs=None,
        advantages=torch.randn(4, A, generator=g),
        vision=batch.vision,
    )
    actor.train_step(exp)
    r["after"] = actor.state_dict_full()
    opt = actor.engine.optimizer  # ZeRO-3: the fp32 master partitions and Adam's states over them
    r["master_numel"] = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
    r["adam_numel"] = sum(s["exp_avg"].numel() for s in opt.optimizer.state.values())
    actor.save_checkpoint(os.path.join(out, "ckpt"))
    actor.train_step(exp)  # moves on; the load below must bring the first step's weights back
    actor.load_checkpoint(os.path.join(out, "ckpt"))
    r["reloaded"] = actor.state_dict_full()
    actor.save_hf(os.path.join(out, "export"))
    ref = ReferenceWorker(role_config("ref", **common, zero_stage=0))
    ref.init()
    r["ref"] = ref.log_probs(batch)
    torch.save(r, os.path.join(out, "results.pt"))


def _hf_log_probs(model, batch: SequenceBatch) -> torch.Tensor:
    """(B, A) log-probs of the action tokens from each row alone, unpadded: a plain HF forward."""
    out = torch.zeros(batch.action_mask.shape)
    for i in range(len(batch)):
        real = batch.attention_mask[i].bool()
        ids = batch.sequences[i][real].unsqueeze(0)
        n = int(batch.action_mask[i].sum())
        with torch.no_grad():
            logits = model(input_ids=ids, **batch.vision.rows[i]).logits[0].float()
        lp = torch.log_softmax(logits[-n - 1 : -1], -1)
        out[i, :n] = lp.gather(-1, ids[0, -n:].unsqueeze(-1))[:, 0]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from orlhf.demo.vlm import make_vlm_demo

    root = tmp_path_factory.mktemp("vlm")
    demo = make_vlm_demo(root / "demo")
    images = sorted(str(p) for p in demo.images.iterdir())
    batch = _batch(_prompts(str(demo.model), images[:2]))
    spawn_ranks(_rank_main, 1, str(demo.model), batch, str(root))
    return demo, batch, root, torch.load(root / "results.pt")


def test_log_probs_equal_a_plain_hf_forward_with_the_images(run):
    from transformers import AutoModelForImageTextToText

    demo, batch, _, r = run
    model = AutoModelForImageTextToText.from_pretrained(demo.model, dtype=torch.float32).eval()
    want, mask = _hf_log_probs(model, batch), batch.action_mask
    swapped = SequenceBatch(batch.sequences, batch.attention_mask, mask, VisionRows(batch.vision.rows[1:2] * 4))
    assert ((_hf_log_probs(model, swapped) - want) * mask).abs().max() > 1e-3  # the images matter to the numbers
    assert r["chunked_path"]
    for got in (r["log_probs"], r["chunked"], r["ref"]):
        assert ((got - want) * mask).abs().max() < 1e-5


def test_freeze_visual_encoder_trains_the_language_model_only(run):
    _, _, _, r = run
    before, after = r["before"], r["after"]
    frozen = set(r["frozen"])
    assert frozen and all(n.startswith(("model.vision_model.", "model.connector.")) for n in frozen)
    assert {n for n in before if n.startswith(("model.vision_model.", "model.connector."))} == frozen
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert all(not torch.equal(before[n], after[n]) for n in before if n not in frozen)  # text model and head
    assert r["master_numel"] == r["adam_numel"] == r["trained_numel"]  # no optimizer state for frozen params
    assert r["trained_numel"] < sum(t.numel() for t in before.values())


def test_weight_sync_skips_the_frozen_params(run):
    _, _, _, r = run
    assert r["meta"] == r["sync"]
    assert set(r["meta"]) == set(r["before"]) - set(r["frozen"])


def test_checkpoint_resume_and_export(run):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, _, root, r = run
    assert all(torch.equal(r["reloaded"][n], r["after"][n]) for n in r["after"])
    export = root / "export"
    processor = AutoProcessor.from_pretrained(export)
    assert type(processor).__name__ == "Idefics3Processor" and processor.chat_template
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[n], r["reloaded"][n]) for n in r["reloaded"])
