"""The start-up clock (phases are the gaps between marks) and the concurrent spawn of model groups."""

import json
import threading
from contextlib import ExitStack

import pytest

from orlhf.distributed.groups import spawn_groups as _spawn_concurrently
from orlhf.launch.startup_clock import StartupClock, process_start_time


def test_phases_are_the_gaps_between_marks_and_add_up(tmp_path, monkeypatch):
    clock = StartupClock(start=100.0)
    for name, t in (("imports", 102.0), ("ray", 109.5), ("groups", 115.0), ("ray", 115.5)):
        monkeypatch.setattr("orlhf.launch.startup_clock.time.time", lambda t=t: t)
        clock.mark(name)
    # imports 100 -> 102, ray 102 -> 109.5 and again 115 -> 115.5, groups 109.5 -> 115
    assert clock.phases() == {"imports": 2.0, "ray": 8.0, "groups": 5.5}
    assert clock.total == 15.5 == sum(clock.phases().values())
    assert clock.report().startswith("start-up 15.5 s to the first step: imports 2.0, ray 8.0, groups 5.5")
    clock.save(tmp_path / "run" / "startup.json")
    assert json.loads((tmp_path / "run" / "startup.json").read_text())["phases_s"]["ray"] == 8.0


def test_process_start_is_in_the_past():
    import time

    assert 0 <= time.time() - process_start_time() < 3600


class _Group:
    def __init__(self, role, shut):
        self.role, self.shut = role, shut

    def shutdown(self):
        self.shut.append(self.role)


def test_groups_spawn_at_the_same_time():
    barrier, shut = threading.Barrier(3, timeout=5), []

    def spawn(role):
        barrier.wait()  # returns only when all three spawns run at once
        return _Group(role, shut)

    with ExitStack() as stack:
        groups = _spawn_concurrently(["actor", "ref", "critic"], spawn, stack)
        assert list(groups) == ["actor", "ref", "critic"]
    assert sorted(shut) == ["actor", "critic", "ref"]


def test_a_failed_spawn_still_shuts_the_others_down():
    shut = []

    def spawn(role):
        if role == "critic":
            raise RuntimeError("critic rank 0 died")
        return _Group(role, shut)

    with pytest.raises(RuntimeError, match="critic rank 0 died"):
        with ExitStack() as stack:
            _spawn_concurrently(["actor", "critic", "ref"], spawn, stack)
    assert sorted(shut) == ["actor", "ref"]
