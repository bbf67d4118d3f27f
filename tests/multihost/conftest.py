"""The multi-host tier: each test builds its own hosts (network namespaces on a bridge, tests/multihost/hosts.py)
with a Ray node in each, and tears them down whatever the test did. Skipped, with the reason, on a machine that
cannot build them (not root, no network namespaces)."""

import pytest

from tests.multihost.hosts import Hosts, can_build_hosts


@pytest.fixture
def hosts():
    """Three hosts, nothing running on them yet: hosts.head (hosts[0]) for the Ray head and the driver."""
    why = can_build_hosts()
    if why is not None:
        pytest.skip(why)
    import ray

    if ray.is_initialized():
        ray.shutdown()  # the session's local cluster: these tests' runs are the only drivers
    with Hosts(3) as built:
        yield built
    assert not built.leftovers(), built.leftovers()
