"""A user's python file, imported by path: --remote_rm_url's reward_func (inputs/rewards.py) and
--agent_func_path's AgentExecutor (rollout/executor.py).

    import_file(path, prefix) -> module        the file's own exception propagates when it fails to import
    import_failure(exc, path) -> message       "<path> failed to import: <type>: <msg>" and the file's frames
    user_frames(exc, path)    -> lines         where in the user's file an exception came from
    source_problem(path, name) -> message|None  what the source shows without running it (before Ray starts)

Each caller wraps the failure in its own error (RewardError, AgentError, DataError) with its own fix.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import itertools
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Optional

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


def source_problem(path: str, name: str) -> Optional[str]:
    """What the file's source shows without running any of it: a syntax error, a top-level import of a module
    Python cannot find (looked up, not imported), or no top-level `name` where the file would have to define it.
    None when none of these; importing it may still fail (its top-level code runs only then). Imports inside a
    function, an `if` or a `try` are not looked up: they may be optional."""
    source = Path(path).read_bytes()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        return f"{path} failed to import: SyntaxError: {e.msg}\n  {path}, line {e.lineno}: {(e.text or '').strip()}"
    lines = source.decode("utf-8", "replace").splitlines()
    for node in tree.body:
        for module in _imported_modules(node):
            if importlib.util.find_spec(module) is None:  # a top-level name: its finders only, no module code runs
                return (
                    f"{path} failed to import: ModuleNotFoundError: No module named {module!r}\n"
                    f"  {path}, line {node.lineno}: {lines[node.lineno - 1].strip()}"
                )
    if not _may_define(tree, name):
        return f"{path} defines no {name}"
    return None


def _imported_modules(node: ast.stmt) -> list[str]:
    """The top-level package names a module-level import statement needs (relative imports: none)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    return []


def _may_define(tree: ast.Module, name: str) -> bool:
    """Whether the module may bind `name`: a def, class, assignment or import of it anywhere in the file, or anything
    that binds names the source does not spell (a star import, globals(), exec). Generous on purpose: a wrong "defines
    no" would stop a good run, a missed one still fails at the import."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = [alias.asname or alias.name.split(".")[0] for alias in node.names]
            if name in bound or "*" in bound:
                return True
        if isinstance(node, ast.Name) and node.id in ("globals", "exec", "setattr", "vars"):
            return True
    return False
