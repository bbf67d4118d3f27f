"""A user's file imported by path (orlhf/inputs/user_files.py): the one loader behind --remote_rm_url's reward_func
and --agent_func_path's AgentExecutor."""

import sys
import textwrap

import pytest

from orlhf.inputs.user_files import NotImportable, import_failure, import_file, user_frames


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
