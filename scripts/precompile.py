"""Byte-compile, at install, the modules an orlhf run imports, so that its processes do not compile them from source
at every start.

Why: uv installs without .pyc files, and where PYTHONDONTWRITEBYTECODE is set (CI images often set it) Python never
writes them on import either. Then each of a run's Python processes (the driver, every rank actor and engine, Ray's
own daemons) compiles every module it imports, at every start (benchmarks/results/2026-11-22-quickstart-and-install.md
measures the imports with and without .pyc). Only the package folders an orlhf run touches (listed in
precompile_dirs.txt) are compiled, once per install, not every installed package.

    python scripts/precompile.py                    # compile them (scripts/install.sh runs this)
    python scripts/precompile.py --hook DIR DUMPS   # write DIR/sitecustomize.py: every process started with DIR on
                                                    # PYTHONPATH dumps its imported files into DUMPS every 3 s
    python scripts/precompile.py --record DUMPS     # rewrite precompile_dirs.txt from those dumps (after a run:
        PYTHONPATH=DIR orlhf train-ppo --num_episodes 1 --max_samples 64 --save_path /tmp/x)

Folders are listed relative to site-packages (non-recursive: the .py files directly in each); folders missing in
this environment are skipped, so a list made with the CPU build serves the GPU one too (it compiles less there).
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


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def files_to_compile() -> list[str]:
    rel = [ln.strip() for ln in LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    files = []
    for site in site_dirs():
        for r in rel:
            d = site / r
            if d.is_dir():
                files += [str(d / f) for f in os.listdir(d) if f.endswith(".py")]
    # orlhf itself (an editable install compiles into the checkout's __pycache__ folders, which git ignores)
    files += [str(p) for p in (HERE.parent / "orlhf").rglob("*.py")]
    return files


def compile_all() -> None:
    t0 = time.time()
    files = files_to_compile()
    with ProcessPoolExecutor(os.cpu_count() or 1) as ex:
        ok = sum(ex.map(_one, files, chunksize=64))
    print(
        f"[install] byte-compiled {ok} of {len(files)} modules an orlhf run imports in {time.time() - t0:.0f} s",
        file=sys.stderr,
    )


def record(dumps: Path) -> None:
    dirs: set[str] = set()
    for dump in dumps.glob("*.txt"):
        for line in dump.read_text().splitlines():
            if "site-packages/" in line and line.endswith(".py"):
                dirs.add(os.path.dirname(line.split("site-packages/", 1)[1]) or ".")
    LIST.write_text(
        "# site-packages folders whose modules an orlhf demo run imported (scripts/precompile.py)\n"
        + "\n".join(sorted(dirs))
        + "\n"
    )
    print(f"{len(dirs)} folders -> {LIST}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hook"]:
        hook_dir, dumps = Path(sys.argv[2]), Path(sys.argv[3]).resolve()
        hook_dir.mkdir(parents=True, exist_ok=True)
        dumps.mkdir(parents=True, exist_ok=True)
        (hook_dir / "sitecustomize.py").write_text(HOOK % str(dumps))
    elif sys.argv[1:2] == ["--record"]:
        record(Path(sys.argv[2]))
    else:
        compile_all()
