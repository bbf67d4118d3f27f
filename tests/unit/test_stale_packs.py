"""The check that no engine module computes with a stale pre-packed copy after a sync (rollout/reload_fixes.py
stale_packs, rollout/weight_sync.py check_no_stale_packs). Pure logic: a module tree whose head shares its
embedding's weight, post-processing that "packs" a copy, and a reload that writes the shared weight and
post-processes only the module it loaded, as vLLM's does; tests/vllm/test_sync_guard_breaks.py runs a real engine."""

import pytest
import torch
from torch import nn

from orlhf.rollout.reload_fixes import refreshed_after_reload, stale_packs
from orlhf.rollout.weight_sync import SyncStalePackError, check_no_stale_packs


class Packing:
    """A quant_method whose post-processing keeps a packed copy of the weight, as vLLM-CPU's oneDNN pre-pack."""

    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().clone()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head, self.norm = nn.Module(), nn.Module(), nn.Module()
        self.embed.weight = nn.Parameter(torch.randn(8, 4))
        self.head.weight = self.embed.weight  # tied
        self.norm.weight = nn.Parameter(torch.ones(4))  # no post-processing: never watched
        for m in (self.embed, self.head):
            m.quant_method = Packing()
            m.quant_method.process_weights_after_loading(m)


def reload(model: Tied, step: float) -> None:
    """vLLM's reload of the embedding alone: write the new values into the old storage, post-process that module."""
    with torch.no_grad():
        model.embed.weight.add_(step)
    model.embed.quant_method.process_weights_after_loading(model.embed)


def test_a_tied_head_whose_weight_changed_without_its_pack_is_stale():
    model = Tied()
    with stale_packs(model) as stale:
        reload(model, 1e-6)
    assert stale == {"head"}
    assert not torch.equal(model.head.packed, model.head.weight)  # what the check saw


def test_the_fix_up_inside_leaves_nothing_stale():
    model = Tied()
    with stale_packs(model) as stale, refreshed_after_reload(model):
        reload(model, 1e-6)
    assert stale == set()
    assert torch.equal(model.head.packed, model.head.weight)
    assert "process_weights_after_loading" not in vars(model.head.quant_method)  # the wrappers are gone


@pytest.mark.parametrize("change", ["one ulp", "two values swapped"])
def test_the_smallest_change_of_a_shared_weight_is_seen(change):
    """Any change of the shared tensor's bytes: one value moved by its last bit, or two values trading places
    (which keeps every sum of the values and of their squares)."""
    model = Tied()
    with stale_packs(model) as stale:
        with torch.no_grad():
            w = model.embed.weight.view(-1)
            if change == "one ulp":
                w[3] = torch.nextafter(w[3], torch.tensor(float("inf")))
            else:
                w[[3, 5]] = w[[5, 3]].clone()
    assert stale == {"embed", "head"}  # changed, and neither module post-processed


def test_a_reload_that_changes_nothing_shared_is_not_stale():
    model = Tied()
    with stale_packs(model) as stale:
        with torch.no_grad():
            model.norm.weight.add_(1.0)
    assert stale == set()


class Answers:
    def __init__(self, per_engine):
        self.per_engine = per_engine

    def get(self, timeout=None):
        return self.per_engine


class Engines:
    def __init__(self, per_engine):
        self.per_engine = per_engine

    def call(self, method):
        assert method.__name__ == "orlhf_stale_packs"
        return Answers(self.per_engine)


def test_the_driver_stops_on_a_stale_pack_naming_engine_and_module():
    check_no_stale_packs(Engines([[[]], [[], []]]))
    with pytest.raises(SyncStalePackError, match=r"engine 1 still computes lm_head with a pre-packed copy"):
        check_no_stale_packs(Engines([[[]], [["lm_head"], []]]))
