"""docs/architecture.md's reading order names real code: every `symbol` in it exists in the module named before it
(orlhf/<path>.py), so a rename that leaves the guide behind fails here."""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def references() -> list[tuple[str, str]]:
    """(module, symbol) for each `symbol` of the reading order, the module the last orlhf path before it."""
    section = DOC.read_text().split("## Reading order", 1)[1]
    out, module = [], None
    for token in re.finditer(r"(?:orlhf/)?((?:[a-z_]+/)+[a-z_]+)\.py|`([A-Za-z_][\w.]*)`", section):
        if token.group(1):  # a path into orlhf/ (others, e.g. benchmarks/, end the module's scope)
            inside = (ROOT / "orlhf" / token.group(1).split("/")[0]).is_dir()
            module = "orlhf." + token.group(1).replace("/", ".") if inside else None
        elif module is not None and not token.group(2).startswith("orlhf"):
            out.append((module, token.group(2)))
    return out


def test_the_reading_order_points_at_real_functions():
    refs = references()
    assert len(refs) >= 8
    missing = []
    for module, symbol in refs:
        obj = importlib.import_module(module)
        for part in symbol.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(f"{module}: {symbol}")
    assert missing == [], "docs/architecture.md's reading order names code that does not exist"
