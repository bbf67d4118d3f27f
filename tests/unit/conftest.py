"""Fixtures shared by the unit tests."""

import pytest


@pytest.fixture
def no_training(monkeypatch):
    """Parse only: the CLI hands the config to a stand-in for launch.run.train_ppo; yields the configs it got (the run
    itself is covered by the e2e tests)."""
    import orlhf.launch.run

    seen = []
    monkeypatch.setattr(orlhf.launch.run, "train_ppo", lambda cfg: seen.append(cfg) or 0)
    return seen
