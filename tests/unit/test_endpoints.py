"""Typed remote calls (orlhf/distributed/endpoints.py): a group accepts only an exported method of its own worker class,
and says so before anything is sent. The real groups' calls run in tests/ray and tests/vllm."""

import pytest

from orlhf.distributed.endpoints import check_exports, endpoint, exports, method_name
from orlhf.rollout.engine import ROLE, EngineActor
from orlhf.rollout.worker_ext import WeightSyncExtension
from orlhf.workers import CriticWorker, PolicyWorker, ReferenceWorker
from orlhf.workers.base import DeepSpeedWorker


class Base:
    @endpoint
    def init(self):
        pass

    def helper(self):  # not exported
        pass


class Worker(Base):
    @endpoint
    def work(self, x):
        return x

    def init(self):  # an override of an exported method stays exported
        pass


def test_an_exported_method_and_an_inherited_one_resolve_to_their_names():
    assert method_name("actor", Worker, Worker.work) == "work"
    assert method_name("actor", Worker, Base.init) == "init"  # the base's reference calls the override
    assert sorted(exports(Worker)) == ["init", "work"]
    assert exports(Worker)["init"] is Worker.init
    assert method_name("critic", CriticWorker, DeepSpeedWorker.save_checkpoint) == "save_checkpoint"


def test_a_misspelt_method_fails_where_the_reference_is_written():
    with pytest.raises(AttributeError, match="log_prob"):
        PolicyWorker.log_prob  # noqa: B018 - a rename or a typo breaks here, before any call is built


def test_a_method_that_is_not_exported_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"actor: Worker.helper is not exported to its group; mark it @endpoint"):
        method_name("actor", Worker, Worker.helper)


def test_a_string_or_another_roles_method_is_refused():
    with pytest.raises(TypeError, match=r"call PolicyWorker.log_probs by reference, not by the string 'log_probs'"):
        method_name("actor", PolicyWorker, "log_probs")
    with pytest.raises(TypeError, match=r"critic: PolicyWorker.log_probs is not a method of CriticWorker"):
        method_name("critic", CriticWorker, PolicyWorker.log_probs)
    with pytest.raises(TypeError, match=r"ref: PolicyWorker.train_step is not a method of ReferenceWorker"):
        method_name("ref", ReferenceWorker, PolicyWorker.train_step)
    with pytest.raises(TypeError, match=r"is not a method of EngineActor"):
        method_name(ROLE, EngineActor, lambda: None)


def test_a_group_of_a_class_that_exports_nothing_or_a_name_twice_is_refused_at_build():
    class Plain:
        def work(self):
            pass

    with pytest.raises(TypeError, match=r"critic: .*Plain exports no methods; mark the ones its group calls"):
        check_exports("critic", Plain)
    with pytest.raises(TypeError, match=r"init is exported by both Worker and Base"):
        check_exports("x", Worker, Base)
    check_exports(ROLE, EngineActor, WeightSyncExtension)  # the real engine group's classes


def test_the_groups_refuse_a_bad_reference_before_sending_anything():
    """The real group classes, without Ray: the check runs before any actor handle is touched."""
    from orlhf.distributed.groups import ActorGroup
    from orlhf.rollout.engine_group import EngineGroup

    group = object.__new__(ActorGroup)
    group.role, group.worker_cls, group.world_size, group.actors = "critic", CriticWorker, 2, None
    with pytest.raises(TypeError, match="not a method of CriticWorker"):
        group.call(PolicyWorker.log_probs)
    with pytest.raises(TypeError, match="not exported"):
        group.call_sharded(CriticWorker.build_model, [1, 2])
    engines = object.__new__(EngineGroup)
    engines._engines = None
    with pytest.raises(TypeError, match="not a method of EngineActor"):
        engines.call(PolicyWorker.send_weights)
    with pytest.raises(TypeError, match=r"WeightSyncExtension._orlhf_reload is not exported"):
        engines.call(WeightSyncExtension._orlhf_reload)
