"""Shared fixtures. One local Ray cluster serves the whole test session (a Ray start is slow)."""

import os
from collections import defaultdict

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Logical CPUs the local test cluster advertises: rank actors and engines each take a CPU slot in placement,
# while the machine has 2 cores. Logical CPUs are accounting only.
TEST_CLUSTER_CPUS = 16


@pytest.fixture
def ray_local():
    """A connection to the session's local Ray cluster, started on first use.

    Tests that need their own cluster (ray.cluster_utils.Cluster) call ray.shutdown() first; the next test that
    asks for this fixture starts a fresh local one.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=TEST_CLUSTER_CPUS,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
            runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}},
        )
    yield ray


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds the folder name
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:
        pass


# Where the suite's time goes, by folder and by file (setup, call and teardown together): the CI log then says which
# tier grew when the whole run does, which pytest's per-test --durations cannot (a slow fixture is spread over many).
_SPENT: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _SPENT[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _SPENT:
        return
    folders: dict[str, float] = defaultdict(float)
    for path, spent in _SPENT.items():
        folders[os.path.dirname(path)] += spent
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "time by folder, then the 20 slowest files (seconds)")
    for folder, spent in sorted(folders.items(), key=lambda kv: -kv[1]):
        write(f"{spent:8.1f}  {folder}/")
    for path, spent in sorted(_SPENT.items(), key=lambda kv: -kv[1])[:20]:
        write(f"{spent:8.1f}  {path}")
