"""distributed/ray_start.with_quick_connects: a cluster orlhf starts retries Ray's socket connections every 0.1 s,
as many times more (the same 10 s before giving up), beside the tuning's own system config, unless the user's
environment or the options set either."""

from orlhf.distributed.ray_start import QUICK_CONNECTS, with_quick_connects


def test_added_beside_the_tunings_system_config(monkeypatch):
    for name in QUICK_CONNECTS:
        monkeypatch.delenv(f"RAY_{name}", raising=False)
    tuning = {"_system_config": {"preload_python_modules": ["orlhf.cpu.preload"]}, "object_store_memory": 10**9}
    out = with_quick_connects(tuning)
    assert out == {
        "_system_config": {"preload_python_modules": ["orlhf.cpu.preload"], **QUICK_CONNECTS},
        "object_store_memory": 10**9,
    }
    assert tuning["_system_config"] == {"preload_python_modules": ["orlhf.cpu.preload"]}  # not changed in place
    interval, attempts = QUICK_CONNECTS.values()
    assert interval * attempts == 1000 * 10  # Ray's defaults: 10 attempts 1 s apart


def test_the_users_environment_and_the_options_win(monkeypatch):
    """A retry setting the user gives keeps the other at Ray's value too (else their product, Ray's give-up
    time, would be neither the user's nor Ray's)."""
    for name in QUICK_CONNECTS:
        monkeypatch.delenv(f"RAY_{name}", raising=False)
    monkeypatch.setenv("RAY_raylet_client_connect_timeout_milliseconds", "5000")
    assert with_quick_connects({}) == {}
    monkeypatch.delenv("RAY_raylet_client_connect_timeout_milliseconds")
    given = {"_system_config": {"raylet_client_num_connect_attempts": 3}}
    assert with_quick_connects(given) == given
