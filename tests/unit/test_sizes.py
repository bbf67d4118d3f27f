"""Sizes stay readable, so a file reads top to bottom and a function fits on a screen: no module under orlhf/ over
MAX_FILE_LINES lines, no function (def or async def, nested ones included, decorators not counted) over
MAX_FUNCTION_LINES. A file or function that grows past the line is split by meaning, not cut at a line count."""

import ast
from pathlib import Path

ORLHF = Path(__file__).resolve().parents[2] / "orlhf"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def offenders(root: Path = ORLHF) -> list[str]:
    """'path:line  what (N lines)' for every file and function over its limit, in path order."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(root.parent)
        n = len(text.splitlines())
        if n > MAX_FILE_LINES:
            found.append(f"{where}:1  file ({n} lines > {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1  # from the `def` line: decorators excluded
                if size > MAX_FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno}  {node.name}() ({size} lines > {MAX_FUNCTION_LINES})")
    return found


def test_no_file_or_function_over_its_size():
    found = offenders()
    assert not found, (
        f"{len(found)} over the size limits (files {MAX_FILE_LINES} lines, functions {MAX_FUNCTION_LINES}); split "
        "each by meaning (a phase, a case, a concern of its own), not at a line count:\n  " + "\n  ".join(found)
    )


def test_the_guard_measures_functions_without_their_decorators(tmp_path):
    pkg = tmp_path / "orlhf"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    (pkg / "ok.py").write_text(f"@decorator\n@another\ndef fits():\n{body}\n")  # def + 59 lines: exactly 60
    (pkg / "long.py").write_text(f"async def grows():\n{body}\n    x = 0\n" + "\n" * MAX_FILE_LINES)
    assert offenders(pkg) == [
        f"orlhf/long.py:1  file ({MAX_FUNCTION_LINES + 1 + MAX_FILE_LINES} lines > {MAX_FILE_LINES})",
        f"orlhf/long.py:1  grows() ({MAX_FUNCTION_LINES + 1} lines > {MAX_FUNCTION_LINES})",
    ]
