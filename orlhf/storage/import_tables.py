"""Import-time hooks: patch_when_imported(m, f) runs f() right after module m is first imported
(cpu/vllm_import.py)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def patch_when_imported(name: str, patch: Callable[[], None]) -> None:
    """Run `patch` right after module `name` is first imported (at once if it is imported already)."""
    if name in sys.modules:
        patch()
        return

    class PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return None
            exec_module = spec.loader.exec_module

            def exec_then_patch(module):
                exec_module(module)
                patch()

            spec.loader.exec_module = exec_then_patch
            return spec

    sys.meta_path.insert(0, PatchAfterImport())
