"""Byte-compile, at install, the modules an orlhf run imports, so that its processes do not compile them from source
at every start.

Why: uv installs without .pyc files, and where PYTHONDONTWRITEBYTECODE is set (CI images often set it) Python never
writes them on import either. Then each of a run's Python processes (the driver, every rank actor and engine, Ray's
own daemons) compiles every module it imports, at every start (benchmarks/results/2026-11-22-quickstart-and-install.md
measures the imports with and without .pyc). Only the package folders an orlhf run touches (listed in
precompile_dirs.txt) are compiled, once per install, not every installed package.

    python scripts/precompile.py                    # compile them (scripts/install.sh runs this)
    python scripts/precompile.py --only torch       # only the entries under these top-level names (comma-separated)
    python scripts/precompile.py --skip torch       # every entry but those (install.sh compiles torch while the
                                                    # other packages install, then the rest)
    python scripts/precompile.py --hook DIR DUMPS   # write DIR/sitecustomize.py: every process started with DIR on
                                                    # PYTHONPATH dumps its imported files into DUMPS every 3 s
    python scripts/precompile.py --record DUMPS     # rewrite precompile_dirs.txt from those dumps (after a run:
        PYTHONPATH=DIR orlhf train-ppo --num_episodes 1 --max_samples 64 --save_path /tmp/x)

Entries are relative to site-packages: a folder (the .py files directly in it, non-recursive) where a run imported
at least DENSE of its files, else each imported file of it, so that big folders a run samples (vLLM's model files,
generated protobuf and telemetry modules) cost only what is imported. Entries missing in this environment are
skipped, so a list made with the CPU build serves the GPU one too (it compiles less there).
py_compile writes .pyc whatever PYTHONDONTWRITEBYTECODE says: the variable governs imports only.
"""

from __future__ import annotations

import compileall
import os
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIST = HERE / "precompile_dirs.txt"
DENSE = 0.7  # a folder is listed whole where a run imported at least this share of its files

HOOK = """import os, sys, threading, time
def _dump():
    while True:
        time.sleep(3)
        try:
            files = sorted({getattr(m, "__file__", None) or "" for m in list(sys.modules.values())} - {""})
            with open(os.path.join(%r, f"{os.getpid()}.txt"), "w") as f:
                f.write("\\n".join(files))
        except Exception:
            pass
threading.Thread(target=_dump, daemon=True).start()
"""


def _one(path: str) -> bool:
    return bool(compileall.compile_file(path, quiet=2))


def _py_files(folder: Path) -> list[str]:
    return [f for f in os.listdir(folder) if f.endswith(".py")] if folder.is_dir() else []


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def _top(entry: str) -> str:
    return entry.split("/", 1)[0]


def files_to_compile(only: set[str] | None = None, skip: frozenset[str] = frozenset()) -> list[str]:
    """The .py files of precompile_dirs.txt's entries present here (and orlhf's own), restricted to the entries whose
    top-level name is in `only` (orlhf itself counts as "orlhf") and not in `skip`."""
    rel = [ln.strip() for ln in LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    rel = [r for r in rel if (only is None or _top(r) in only) and _top(r) not in skip]
    files = []
    for site in site_dirs():
        for r in rel:
            d = site / r
            if r.endswith(".py"):
                files += [str(d)] if d.is_file() else []
            else:
                files += [str(d / f) for f in _py_files(d)]
    # orlhf itself (an editable install compiles into the checkout's __pycache__ folders, which git ignores)
    if (only is None or "orlhf" in only) and "orlhf" not in skip:
        files += [str(p) for p in (HERE.parent / "orlhf").rglob("*.py")]
    return files


def compile_all(only: set[str] | None = None, skip: frozenset[str] = frozenset()) -> None:
    t0 = time.time()
    files = files_to_compile(only, skip)
    with ProcessPoolExecutor(os.cpu_count() or 1) as ex:
        ok = sum(ex.map(_one, files, chunksize=64))
    print(
        f"[install] byte-compiled {ok} of {len(files)} modules an orlhf run imports in {time.time() - t0:.0f} s",
        file=sys.stderr,
    )


def record(dumps: Path) -> None:
    imported: dict[str, set[str]] = {}  # folder relative to site-packages -> the names of its imported files
    for dump in dumps.glob("*.txt"):
        for line in dump.read_text().splitlines():
            if "site-packages/" in line and line.endswith(".py"):
                rel = line.split("site-packages/", 1)[1]
                imported.setdefault(os.path.dirname(rel) or ".", set()).add(os.path.basename(rel))
    entries = []
    for folder, names in imported.items():
        present = max((len(_py_files(site / folder)) for site in site_dirs()), default=0)
        if present and len(names) >= DENSE * present:
            entries.append(folder)
        else:
            entries += [os.path.normpath(os.path.join(folder, name)) for name in names]
    LIST.write_text(
        "# site-packages folders, and single files of sparsely imported ones, that an orlhf demo run imported"
        " (scripts/precompile.py)\n" + "\n".join(sorted(entries)) + "\n"
    )
    print(f"{len(entries)} entries -> {LIST}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hook"]:
        hook_dir, dumps = Path(sys.argv[2]), Path(sys.argv[3]).resolve()
        hook_dir.mkdir(parents=True, exist_ok=True)
        dumps.mkdir(parents=True, exist_ok=True)
        (hook_dir / "sitecustomize.py").write_text(HOOK % str(dumps))
    elif sys.argv[1:2] == ["--record"]:
        record(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--only"]:
        compile_all(only=set(sys.argv[2].split(",")))
    elif sys.argv[1:2] == ["--skip"]:
        compile_all(skip=frozenset(sys.argv[2].split(",")))
    else:
        compile_all()
