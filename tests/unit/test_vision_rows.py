"""types.VisionRows: per-row image tensors follow their rows through split / index / cat, and merge as a processor
batches them (Idefics3's (1, images, ...) per prompt padded with all-zero images)."""

import torch

from orlhf.types import SequenceBatch, VisionRows


def _rows(counts):
    return [
        None if n == 0 else {"pixel_values": torch.full((1, n, 3, 2, 2), float(i + 1))} for i, n in enumerate(counts)
    ]


def test_vision_follows_its_rows_through_split_index_and_cat():
    b = SequenceBatch(torch.arange(8).view(4, 2), torch.ones(4, 2), torch.ones(4, 1).bool(), VisionRows(_rows([1] * 4)))
    parts = b.split([1, 3])
    assert [len(p.vision) for p in parts] == [1, 3] and parts[1].vision.rows[0]["pixel_values"][0, 0, 0, 0, 0] == 2
    picked = b.index(torch.tensor([3, 0]))
    assert [r["pixel_values"].flatten()[0].item() for r in picked.vision.rows] == [4.0, 1.0]
    again = SequenceBatch.cat(parts)
    assert [r["pixel_values"].flatten()[0].item() for r in again.vision.rows] == [1.0, 2.0, 3.0, 4.0]
    assert SequenceBatch(b.sequences, b.attention_mask, b.action_mask).vision_inputs() == {}


def test_merged_pads_image_counts_with_zero_images_and_skips_text_rows():
    merged = VisionRows(_rows([2, 0, 1])).merged()
    pv = merged["pixel_values"]
    assert pv.shape == (2, 2, 3, 2, 2)
    assert (pv[0] == 1).all() and (pv[1, 0] == 3).all() and (pv[1, 1] == 0).all()
    flat = VisionRows([{"pixel_values": torch.ones(4, 5)}, {"pixel_values": torch.ones(6, 5)}]).merged()
    assert flat["pixel_values"].shape == (10, 5)  # Qwen2-VL's patches: concatenated as they are


def test_text_rows_in_a_vision_run_on_several_zero3_ranks_are_refused_by_row():
    from types import SimpleNamespace as NS

    import pytest

    from orlhf.inputs.prompts import DataError, Prompt
    from orlhf.launch.run_inputs import check_text_rows_fit

    def cfg(ranks, zero_stage=None):
        return NS(
            placement=NS(actor_num_nodes=1, actor_num_gpus_per_node=ranks, ref_num_nodes=1, ref_num_gpus_per_node=1),
            data=NS(max_images_per_prompt=1, image_key="images"),
            deepspeed=NS(zero_stage=zero_stage),
        )

    prompts = [Prompt("a", [1], None, 0, images=(b"png",)), Prompt("b", [1], None, 4)]
    with pytest.raises(DataError, match="prompt row 5 .* has no image"):
        check_text_rows_fit(cfg(2), prompts)
    check_text_rows_fit(cfg(1), prompts)  # one rank: nothing to wait for
    check_text_rows_fit(cfg(2, zero_stage=2), prompts)  # ZeRO-2 gathers nothing in the forward
