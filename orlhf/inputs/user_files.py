"""A user's python file, imported by path: --remote_rm_url's reward_func (inputs/rewards.py) and
--agent_func_path's AgentExecutor (rollout/executor.py).

    import_file(path, prefix) -> module        the file's own exception propagates when it fails to import
    import_failure(exc, path) -> message       "<path> failed to import: <type>: <msg>" and the file's frames
    user_frames(exc, path)    -> lines         where in the user's file an exception came from

Each caller wraps the failure in its own error (RewardError, AgentError) with its own fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
import traceback
from pathlib import Path
from types import ModuleType

_module_ids = itertools.count()  # loading one file twice gives two modules, never a shared or stale one


class NotImportable(ImportError):
    """Python has no loader for the file (not a .py source)."""


def import_file(path: str, prefix: str) -> ModuleType:
    """The module of the file at `path`, imported under a fresh name (<prefix>_<path digest>_<n>).

    Whatever the file raises while importing (SystemExit included) propagates, its sys.modules entry removed;
    NotImportable when python has no loader for the file."""
    digest = hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:10]
    name = f"{prefix}_{digest}_{next(_module_ids)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotImportable(f"{path}: python cannot import this file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, as importlib's recipe does: dataclasses and pickle look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def import_failure(exc: BaseException, path: str) -> str:
    """The first lines of an error for a file that failed to import: what it raised, and where in it."""
    return f"{path} failed to import: {type(exc).__name__}: {exc}\n{user_frames(exc, path)}"


def user_frames(exc: BaseException, path: str, limit: int = 3) -> str:
    """The traceback lines in the user's file (else the innermost one): where to look, without orlhf's frames."""
    frames = traceback.extract_tb(exc.__traceback__)
    target = Path(path).resolve()
    mine = [f for f in frames if Path(f.filename).resolve() == target] or frames[-1:]
    return "\n".join(f"  {f.filename}, line {f.lineno}, in {f.name}: {(f.line or '').strip()}" for f in mine[-limit:])
