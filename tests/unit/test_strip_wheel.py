"""scripts/strip_wheel.py on a small synthetic wheel: the dropped members go, RECORD lists exactly what remains (sha256
and size as the wheel spec says), and pip installs the result. No network: pip installs the local file only."""

import base64
import csv
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("strip_wheel", ROOT / "scripts" / "strip_wheel.py")
strip_wheel = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(strip_wheel)

DIST = "demo_pkg-1.0.dist-info"
FILES = {
    "demo_pkg/__init__.py": b"from demo_pkg.mod import VALUE\n",
    "demo_pkg/mod.py": b"VALUE = 42\n",
    "demo_pkg/data/notes.txt": b"kept\n",
    "demo_pkg/jars/big.jar": os.urandom(4096),
    "demo_pkg/jars/more/other.jar": b"x" * 1000,
    "demo_pkg/client/build/index.html": b"<html></html>\n",
    f"{DIST}/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
    f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
DROPS = ["demo_pkg/jars/*", "demo_pkg/client/build/*"]


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path) -> Path:
    wheel = folder / "demo_pkg-1.0-py3-none-any.whl"
    buf = io.StringIO()
    rows = [(name, digest(data), len(data)) for name, data in FILES.items()] + [(f"{DIST}/RECORD", "", "")]
    csv.writer(buf, lineterminator="\n").writerows(rows)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("demo_pkg/jars/", b"")  # a directory entry under a dropped folder
        for name, data in FILES.items():
            zf.writestr(name, data)
        zf.writestr(f"{DIST}/RECORD", buf.getvalue())
    return wheel


def test_strip_drops_members_rewrites_record_and_installs(tmp_path, capsys):
    src = make_wheel(tmp_path)
    assert strip_wheel.check_record(src) == []
    args = [str(src), str(tmp_path / "out")] + [a for g in DROPS for a in ("--drop", g)]
    assert strip_wheel.main(args) == 0
    out = tmp_path / "out" / src.name
    printed = capsys.readouterr().out
    assert "dropped demo_pkg/jars/*: 2 file(s)" in printed and "RECORD consistent" in printed

    kept = {n: d for n, d in FILES.items() if not n.startswith(("demo_pkg/jars/", "demo_pkg/client/build/"))}
    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
        assert sorted(names) == sorted([*kept, f"{DIST}/RECORD"])
        rows = list(csv.reader(io.StringIO(zf.read(f"{DIST}/RECORD").decode())))
    assert sorted(rows) == sorted([[n, digest(d), str(len(d))] for n, d in kept.items()] + [[f"{DIST}/RECORD", "", ""]])
    assert strip_wheel.check_record(out) == []

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--disable-pip-version-check"]
        + ["--target", str(target), str(out)],
        check=True,
    )
    assert not (target / "demo_pkg" / "jars").exists() and not (target / "demo_pkg" / "client").exists()
    got = subprocess.run(
        [sys.executable, "-c", "import demo_pkg; print(demo_pkg.VALUE)"],
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert got.stdout.strip() == "42"


def test_check_finds_a_wrong_record_and_strip_refuses_bad_globs(tmp_path):
    src = make_wheel(tmp_path)
    bad = tmp_path / "bad" / src.name
    bad.parent.mkdir()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            zout.writestr(name, b"VALUE = 43\n" if name == "demo_pkg/mod.py" else data)
        zout.writestr("demo_pkg/extra.py", b"")
    problems = strip_wheel.check_record(bad)
    assert any("demo_pkg/mod.py: hash" in p for p in problems)
    assert any("demo_pkg/extra.py is in the wheel but not in RECORD" in p for p in problems)
    assert strip_wheel.main(["--check", str(bad)]) == 1

    with pytest.raises(SystemExit, match="no member of .* matches"):
        strip_wheel.strip(src, tmp_path / "out", ["demo_pkg/nope/*"])
    with pytest.raises(SystemExit, match="dist-info members are never dropped"):
        strip_wheel.strip(src, tmp_path / "out", [f"{DIST}/*"])
    with pytest.raises(SystemExit, match="overwrite the input"):
        strip_wheel.strip(src, tmp_path, DROPS)
    assert not (tmp_path / "out").exists()
