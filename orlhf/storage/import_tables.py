"""transformers' lazy-module tables read from a cache file instead of from every model file, in each process.

    install()                  in a process before it imports transformers (the `orlhf` command's first
                               lines, a CPU cluster's worker preload, a rank or engine actor's start); nothing
                               if transformers is imported already
    patch_when_imported(m, f)  f() right after module m is first imported (also used by cpu/vllm_import.py)

Why: `import transformers` builds its lazy module's table of what every model folder exports
(transformers.utils.import_utils.define_import_structure): it reads every source file under transformers/models
and scans it for `__all__` and `@requires`, and transformers.models builds the same table once more. That is a
large part of importing transformers, paid by every process of a run (the driver, each rank, each engine) while
they all start on the same cores. The table depends only on those files, so it is kept in
<cache>/transformers-tables/ (the cache folder of demo/builder.default_cache_dir) as JSON, one file per folder
and stamp: the stamp digests transformers' version and the name, size and modification time of every file under
the folder, so any change to those files (an upgrade, an edited source checkout) makes a new table, and nodes
sharing a home folder with different installs each keep their own. A cache that cannot be read or written is
ignored: transformers then builds the table as it always does. transformers' lazy modules come out the same
(tests/unit/test_import_tables.py compares them).

The same module also asks, at its first lines, which installed distribution provides each top-level package
(importlib.metadata.packages_distributions: it opens the metadata and the file list of every installed
distribution). While that module runs, the answer is read from the same cache folder when the distributions are
the ones it was computed from: the stamp digests Python's version, sys.path, and for each folder on it the name
of every .dist-info/.egg-info entry with the size and modification time of the files the answer is read from. A
process with another distribution finder on sys.meta_path computes it as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Callable, Optional

IMPORT_UTILS = "transformers.utils.import_utils"
FOLDER = "transformers-tables"


def install() -> None:
    """transformers' define_import_structure answered from the cache (module docstring) for the rest of the
    process, from its first import on; nothing if transformers is imported already (its tables are built)."""
    if "transformers" in sys.modules:
        return
    patch_when_imported(IMPORT_UTILS, _cache_tables, during=cached_distributions)


def patch_when_imported(name: str, patch: Callable[[], None], during: Optional[Callable] = None) -> None:
    """Run `patch` right after module `name` is first imported (at once if it is imported already). `during`: a
    context manager factory, entered while the module's code runs (not at all if it is imported already)."""
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
                with during() if during is not None else contextlib.nullcontext():
                    exec_module(module)
                patch()

            spec.loader.exec_module = exec_then_patch
            return spec

    sys.meta_path.insert(0, PatchAfterImport())


def _cache_tables() -> None:
    module = sys.modules[IMPORT_UTILS]
    build = getattr(module, "define_import_structure", None)
    if build is None or getattr(build, "_orlhf_cached", False):
        return
    version = _transformers_version()

    @functools.wraps(build)
    def define_import_structure(module_path, prefix=None):
        return cached_tables(build, module_path, prefix, version)

    define_import_structure._orlhf_cached = True
    module.define_import_structure = define_import_structure


def cached_tables(build: Callable, module_path, prefix, version: str):
    """build(module_path, prefix), or the same table read from its cache file when the folder's files are the
    ones it was built from."""
    folder = str(module_path)
    if os.path.isfile(folder):  # transformers reads the folder of a file it is given
        folder = os.path.dirname(folder)
    try:
        stamp = folder_stamp(folder, version)
        path = cache_file(folder, prefix, stamp)
    except Exception:  # noqa: BLE001 - no usable cache (a folder gone, no home folder): transformers' own build
        return build(module_path, prefix)
    table = read_table(path, stamp)
    if table is None:
        table = build(module_path, prefix)
        write_table(path, stamp, table)
    return table


def folder_stamp(folder: str, version: str) -> str:
    """A digest of transformers' version and the relative path, size and modification time of every file under
    `folder` (the files define_import_structure reads; __pycache__ left out)."""
    digest = hashlib.sha256(version.encode())
    for rel, size, mtime in sorted(_files(folder, "")):
        digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
    return digest.hexdigest()


def _files(folder: str, rel: str) -> list[tuple[str, int, int]]:
    out = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name == "__pycache__":
                continue
            name = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir():
                out += _files(entry.path, name)
            else:
                st = entry.stat()
                out.append((name, st.st_size, st.st_mtime_ns))
    return out


def cache_file(folder: str, prefix, stamp: str) -> str:
    from orlhf.demo.builder import default_cache_dir

    key = hashlib.sha256(f"{os.path.realpath(folder)}\0{prefix}\0{stamp}".encode()).hexdigest()[:32]
    return os.path.join(default_cache_dir(), FOLDER, f"{key}.json")


def read_table(path: str, stamp: str):
    """The table stored at `path` if it carries `stamp`, else None (also when it is missing or unreadable)."""
    try:
        return {
            frozenset(backends): {m: set(names) for m, names in modules.items()}
            for backends, modules in _read_json(path, stamp)["table"]
        }
    except Exception:  # noqa: BLE001 - missing, damaged or another shape: built again
        return None


def write_table(path: str, stamp: str, table) -> None:
    """`table` ({frozenset of backends: {module: set of names}}) and its stamp to `path`, published by a rename so
    that a reader never sees half a file; nothing when the table has another shape or the folder is not
    writable."""
    try:
        rows = [
            [sorted(backends), {m: sorted(names) for m, names in modules.items()}]
            for backends, modules in table.items()
        ]
        if not all(_strings(b) and all(_strings(n) for n in mods.values()) for b, mods in rows):
            return  # read back, it would not be the same table
        _write_json(path, {"stamp": stamp, "table": rows})
    except Exception:  # noqa: BLE001 - not writable or not JSON: the next process builds it too
        return


def _strings(items) -> bool:
    return all(isinstance(x, str) for x in items)


@contextlib.contextmanager
def cached_distributions():
    """importlib.metadata.packages_distributions answered from the cache (module docstring) while the block runs."""
    import importlib.metadata as metadata

    build = metadata.packages_distributions
    metadata.packages_distributions = functools.wraps(build)(functools.partial(cached_packages, build))
    try:
        yield
    finally:
        metadata.packages_distributions = build


def cached_packages(build: Callable) -> dict:
    """build() ({top-level package: [distribution names]}), or the same mapping read from its cache file when the
    installed distributions are the ones it was computed from."""
    try:
        stamp = distributions_stamp()
        path = None if stamp is None else distributions_file(stamp)
    except Exception:  # noqa: BLE001 - no usable cache: computed as importlib.metadata does
        path = None
    if path is None:
        return build()
    try:
        return {pkg: list(dists) for pkg, dists in _read_json(path, stamp)["packages"].items()}
    except Exception:  # noqa: BLE001 - missing, damaged or another shape: computed again
        pass
    packages = build()
    try:
        if all(isinstance(k, str) and _strings(v) for k, v in packages.items()):
            _write_json(path, {"stamp": stamp, "packages": packages})
    except Exception:  # noqa: BLE001 - not writable: the next process computes it too
        pass
    return packages


def distributions_file(stamp: str) -> str:
    from orlhf.demo.builder import default_cache_dir

    return os.path.join(default_cache_dir(), FOLDER, f"distributions-{stamp[:32]}.json")


# The files of a distribution's metadata that packages_distributions reads: its name (METADATA, PKG-INFO), the
# packages it declares (top_level.txt) or, without that, its file list (RECORD, SOURCES.txt, installed-files.txt).
META_FILES = ("", "METADATA", "PKG-INFO", "top_level.txt", "RECORD", "SOURCES.txt", "installed-files.txt")


def distributions_stamp() -> Optional[str]:
    """A digest of what importlib.metadata finds the installed distributions from (module docstring); None when a
    finder other than the path finder takes part (it could answer from anywhere)."""
    from importlib.machinery import PathFinder

    if any(hasattr(f, "find_distributions") and f is not PathFinder for f in sys.meta_path):
        return None
    digest = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        folder = entry or "."
        digest.update(f"{entry}\0".encode())
        if not os.path.isdir(folder):
            digest.update(f"{_stat(folder)}\n".encode())  # a zip file or nothing
            continue
        with os.scandir(folder) as entries:
            infos = sorted(e.name for e in entries if e.name.lower().endswith((".dist-info", ".egg-info")))
        for name in infos:
            info = os.path.join(folder, name)
            digest.update(f"{name}\0{[_stat(os.path.join(info, f)) for f in META_FILES]}\n".encode())
    return digest.hexdigest()


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    except OSError:
        return ()


def _read_json(path: str, stamp: str) -> dict:
    """The JSON object stored at `path`; KeyError unless it carries `stamp` (OSError, ValueError when missing or
    damaged)."""
    with open(path, encoding="utf-8") as f:
        stored = json.load(f)
    if stored.get("stamp") != stamp:
        raise KeyError(f"{path}: another stamp")
    return stored


def _write_json(path: str, data) -> None:
    """`data` to `path` as JSON, published by a rename so that a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return ""
