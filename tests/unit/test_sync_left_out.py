"""After a sync of the whole model every engine says which of its weights vLLM's reload found no tensor for
(rollout/worker_ext.py orlhf_not_loaded); any stops the run naming them (rollout/weight_sync.py). The engines' answers
here are given (pure logic); tests/vllm/test_sync_guard_breaks.py leaves a layer out of a real engine's sync."""

import logging

import pytest

from orlhf.rollout.reload_fixes import weights_not_loaded
from orlhf.rollout.weight_sync import SyncLeftOutError, check_nothing_left_out


class Answers:
    def __init__(self, per_engine):
        self.per_engine = per_engine

    def get(self, timeout=None):
        return self.per_engine


class Engines:
    """EngineGroup.call's shape: per engine, per tensor-parallel worker, the endpoint's answer."""

    def __init__(self, per_engine):
        self.per_engine = per_engine

    def call(self, method, *args):
        assert method.__name__ == "orlhf_not_loaded"
        return Answers(self.per_engine)


def test_nothing_left_out_passes():
    check_nothing_left_out(Engines([[[]], [[], []]]), 10)


def test_weights_left_out_stop_the_run_naming_the_engine_and_the_weights():
    names = [f"model.layers.1.{p}.weight" for p in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj")]
    with pytest.raises(SyncLeftOutError, match=r"engine 1 no tensor for 3 of its weights \(model\.layers\.1\.mlp"):
        check_nothing_left_out(Engines([[[]], [names[:2], names[2:]]]), 10)
    many = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(9)]
    with pytest.raises(SyncLeftOutError, match="and 3 more"):
        check_nothing_left_out(Engines([[many]]), 10)


def test_vllms_own_warning_is_taken_not_logged_whatever_its_level(caplog):
    """The names come from vLLM's one warning after a reload (its logger and wording, vllm 0.32's inplace.py)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    before = logger.level
    logger.setLevel(logging.ERROR)  # VLLM_LOGGING_LEVEL=ERROR
    try:
        with caplog.at_level(logging.WARNING), weights_not_loaded() as left:
            logger.warning("Following weights were not loaded from checkpoint: %s", {"model.layers.1.mlp.w"})
            logger.warning("another warning")
        assert left == {"model.layers.1.mlp.w"}
        assert [r.getMessage() for r in caplog.records] == ["another warning"]
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)
