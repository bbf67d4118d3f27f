"""Test modules are imported by basename (the test folders are not packages): two files of one name anywhere under
tests/ stop pytest's collection of the whole suite ("import file mismatch"). Caught here, in the unit tests that run
first, with the two paths."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_name():
    by_name = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name != "conftest.py"}
    assert not shared, f"rename one of each: {shared}"
