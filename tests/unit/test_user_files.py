"""A user's file imported by path (orlhf/inputs/user_files.py): the one loader behind --remote_rm_url's reward_func
and --agent_func_path's AgentExecutor."""

import sys
import textwrap

import pytest

from orlhf.inputs.user_files import NotImportable, import_failure, import_file, source_problem, user_frames


def user_file(tmp_path, body, name="mine.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_each_load_is_a_fresh_module_registered_under_its_own_name(tmp_path):
    path = user_file(tmp_path, "import dataclasses\n@dataclasses.dataclass\nclass Row:\n    x: int\nSEEN = []\n")
    a, b = import_file(path, "orlhf_test"), import_file(path, "orlhf_test")
    a.SEEN.append(1)
    assert a is not b and b.SEEN == [] and a.__name__ != b.__name__  # no state shared between two loads
    assert sys.modules[a.__name__] is a and a.__name__.startswith("orlhf_test_")  # dataclasses look it up there
    assert a.Row(1).x == 1


def test_a_failing_file_raises_its_own_error_and_leaves_no_module_behind(tmp_path):
    path = user_file(tmp_path, "import os\nLIMIT = 1 / 0\n")
    before = set(sys.modules)
    with pytest.raises(ZeroDivisionError) as e:
        import_file(path, "orlhf_test")
    assert set(sys.modules) == before
    # import_failure: what it raised, then the user's own line (not orlhf's or importlib's frames)
    msg = import_failure(e.value, path)
    assert msg.startswith(f"{path} failed to import: ZeroDivisionError: division by zero\n")
    assert user_frames(e.value, path) == f"  {path}, line 2, in <module>: LIMIT = 1 / 0"


def test_sys_exit_in_a_file_is_raised_not_swallowed(tmp_path):
    with pytest.raises(SystemExit):
        import_file(user_file(tmp_path, "raise SystemExit(3)\n"), "orlhf_test")


def test_a_file_python_has_no_loader_for_is_not_importable(tmp_path):
    with pytest.raises(NotImportable, match="python cannot import this file"):
        import_file(user_file(tmp_path, "x = 1\n", name="mine.txt"), "orlhf_test")


@pytest.mark.parametrize(
    "body, problem",
    [
        ("def reward_func(q, p, l):\n    return q\n", None),
        ("from math import *\n", None),  # may bind it: not refused
        ("try:\n    import no_such_module_here\nexcept ImportError:\n    pass\ndef reward_func(): pass\n", None),
        ("def reward_func():\n    import no_such_module_here\n", None),  # at call time, maybe never
        (
            "import os\nimport no_such_module_here.sub as s\n",
            "ModuleNotFoundError: No module named 'no_such_module_here'",
        ),
        (
            "from no_such_pkg.x import y\n",
            "No module named 'no_such_pkg'\n  {path}, line 1: from no_such_pkg.x import y",
        ),
        ("def reward_func(q:\n    pass\n", "failed to import: SyntaxError: "),
        ("import os\n\ndef reward(q, p, l):\n    return q\n", "defines no reward_func"),
    ],
)
def test_the_source_is_checked_without_running_it(tmp_path, body, problem):
    """What source_problem finds from the text alone (before Ray starts), and nothing of the file runs."""
    path = user_file(tmp_path, "open(__file__ + '.ran', 'w')\n" + body)
    found = source_problem(path, "reward_func")
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem.format(path=path).replace("line 1", "line 2") in found, found
    assert not (tmp_path / "mine.py.ran").exists()
