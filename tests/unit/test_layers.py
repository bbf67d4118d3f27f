"""The package layers of orlhf/ (docs/architecture.md): each package imports only the packages below it.

Read from the source (every import statement, module level or inside a function), so an import that runs up the
layers fails here before it can make a cycle or drag a top-level dependency into the bottom.
"""

from __future__ import annotations

import ast
from pathlib import Path

ORLHF = Path(__file__).resolve().parents[2] / "orlhf"

# Bottom to top. A module may import its own package and any package on a lower line.
LAYERS = [
    ("__init__", "types", "versions", "algo"),  # pure: payload types, pins, tensor math
    ("demo",),  # the built-in tiny model, prompts and reward
    ("inputs",),  # prompts, reward sources, value-head files, the reward server
    ("config",),  # flags -> frozen TrainConfig
    ("storage",),  # the run folder
    ("distributed",),  # Ray plumbing
    ("workers",),  # DeepSpeed model workers
    ("rollout",),  # rollout backends (vLLM engines, the actor's ranks), their weight sync, executors
    ("trainer",),  # the controller and its phases
    ("cpu",),  # CPU-only tuning, plugged in by launch/ through distributed/tuning.py
    ("launch",),  # one run top to bottom, plan
    ("cli", "entry"),  # the command; entry: its first lines (a run's signal handling before any import)
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}

# Templates a user copies (`orlhf make-demo`): they import orlhf's public API as a user's file does, and orlhf
# loads them by path, never by import.
USER_TEMPLATES = {"demo/agent.py", "demo/reward.py"}
ROOT_MODULES = {"__init__.py", "cli.py", "entry.py", "types.py", "versions.py"}


def top(module: str) -> str:
    """'orlhf.trainer.controller' -> 'trainer'; 'orlhf' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_of(path: Path) -> str:
    rel = path.relative_to(ORLHF)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "orlhf"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "orlhf":
            if node.module == "orlhf":  # from orlhf import x: x may be a package
                out += [f"orlhf.{a.name}" if a.name in LEVEL else "orlhf" for a in node.names]
            else:
                out.append(node.module)
    return out


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(ORLHF.rglob("*.py")):
        rel = path.relative_to(ORLHF).as_posix()
        if rel in USER_TEMPLATES:
            continue
        own = package_of(path)
        assert own in LEVEL, f"orlhf/{rel}: package {own!r} has no layer in LAYERS (tests/unit/test_layers.py)"
        for module in imported(ast.parse(path.read_text())):
            target = top(module)
            assert target in LEVEL, f"orlhf/{rel} imports {module}, which is in no layer"
            if LEVEL[target] > LEVEL[own]:
                bad.append(f"orlhf/{rel} ({own}) imports {module} ({target}), a higher layer")
    return bad


def test_no_import_runs_up_the_layers():
    assert upward_imports() == []


def test_the_root_holds_only_the_cli_and_shared_types():
    assert {p.name for p in ORLHF.glob("*.py")} == ROOT_MODULES


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The check itself: a config module importing the trainer is reported."""
    fake = tmp_path / "orlhf"
    (fake / "config").mkdir(parents=True)
    (fake / "config" / "x.py").write_text("def f():\n    from orlhf.trainer.controller import Controller\n")
    monkeypatch.setitem(globals(), "ORLHF", fake)
    assert upward_imports() == ["orlhf/config/x.py (config) imports orlhf.trainer.controller (trainer), a higher layer"]
