"""Drop members from a wheel and rewrite its RECORD, so the smaller wheel still installs with pip.

    python scripts/strip_wheel.py IN.whl OUT_DIR --drop GLOB [--drop GLOB ...]   # OUT_DIR/<same name>.whl
    python scripts/strip_wheel.py --check WHEEL [WHEEL ...]                     # RECORD against the members

A GLOB is matched (fnmatch, case-sensitive; `*` also crosses `/`) against each member's path in the archive, e.g.
`ray/jars/*`. The written wheel keeps every other member as it was (name, order, date, permission bits) and gets a
`*.dist-info/RECORD` that lists exactly what remains: `path,sha256=<urlsafe base64, no padding>,size`, and RECORD's
own line with empty hash and size (the wheel spec). A glob that matches nothing, or matches a dist-info member, is
an error. Pure stdlib. Used by scripts/gpu_check.sh --build-wheels to fit Ray onto the GPU machine.
"""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path

CHUNK = 1 << 20


def record_hash(digest: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def record_name(names: list[str]) -> str:
    """The wheel's `<name>-<version>.dist-info/RECORD` (the one at the archive's top level)."""
    found = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(found) != 1:
        raise SystemExit(f"expected one top-level *.dist-info/RECORD, found {found or 'none'}")
    return found[0]


def is_signature(name: str, record: str) -> bool:
    """RECORD.jws / RECORD.p7s sign the old RECORD: they cannot stay."""
    return name in (record + ".jws", record + ".p7s")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_record(wheel: Path) -> list[str]:
    """What is wrong with the wheel's RECORD against its members (missing, extra, wrong hash or size); [] if none."""
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = [i.filename for i in zf.infolist() if not i.is_dir()]
        record = record_name(names)
        rows = list(csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8", newline="")))
        listed: dict[str, tuple[str, str]] = {}
        for row in rows:
            if not row:
                continue
            if len(row) != 3:
                problems.append(f"malformed RECORD line {row}")
                continue
            if row[0] in listed:
                problems.append(f"{row[0]} listed twice")
            listed[row[0]] = (row[1], row[2])
        if listed.get(record) != ("", ""):
            problems.append(f"RECORD's own line should be '{record},,', got {listed.get(record)}")
        for name in names:
            if name == record or is_signature(name, record):
                continue
            if name not in listed:
                problems.append(f"{name} is in the wheel but not in RECORD")
                continue
            h, size = hashlib.sha256(), 0
            with zf.open(name) as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
            want_hash, want_size = listed[name]
            if want_hash != record_hash(h.digest()):
                problems.append(f"{name}: hash {want_hash} in RECORD, {record_hash(h.digest())} in the wheel")
            if want_size != str(size):
                problems.append(f"{name}: size {want_size} in RECORD, {size} in the wheel")
        problems += [f"{name} is in RECORD but not in the wheel" for name in listed if name not in set(names)]
    return problems


def strip(src: Path, out_dir: Path, drops: list[str]) -> Path:
    """Write out_dir/<src's name> without the members matching any of drops; returns its path."""
    dst = out_dir / src.name
    if dst.resolve() == src.resolve():
        raise SystemExit(f"{dst} would overwrite the input: pick another OUT_DIR")
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        record = record_name([i.filename for i in infos])
        dist_info = record.split("/")[0] + "/"
        dropped: dict[str, list[zipfile.ZipInfo]] = {g: [] for g in drops}
        kept = []
        for info in infos:
            hits = [g for g in drops if fnmatch.fnmatchcase(info.filename, g)]
            if hits and info.filename.startswith(dist_info):
                raise SystemExit(f"{hits[0]!r} matches {info.filename}: dist-info members are never dropped")
            if hits:
                dropped[hits[0]].append(info)
            elif is_signature(info.filename, record):
                print(f"dropping {info.filename}: it signs the old RECORD")
            elif info.filename != record:
                kept.append(info)
        unmatched = [g for g, infos_ in dropped.items() if not infos_]
        if unmatched:
            raise SystemExit(f"no member of {src.name} matches {unmatched}: nothing written")

        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".whl.part", dir=out_dir)
        os.close(fd)
        try:
            rows = []
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
                for info in kept:
                    new = zipfile.ZipInfo(info.filename, info.date_time)
                    new.compress_type = info.compress_type
                    new.external_attr = info.external_attr
                    new.create_system = info.create_system
                    if info.is_dir():
                        zout.writestr(new, b"")
                        continue
                    h, size = hashlib.sha256(), 0
                    with zin.open(info) as fin, zout.open(new, "w", force_zip64=info.file_size > 2**31) as fout:
                        while chunk := fin.read(CHUNK):
                            h.update(chunk)
                            size += len(chunk)
                            fout.write(chunk)
                    rows.append((info.filename, record_hash(h.digest()), str(size)))
                rows.append((record, "", ""))
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                old = zin.getinfo(record)
                new = zipfile.ZipInfo(record, old.date_time)
                new.compress_type, new.external_attr = old.compress_type, old.external_attr
                zout.writestr(new, buf.getvalue().encode("utf-8"))
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    for glob, infos_ in dropped.items():
        files = [i for i in infos_ if not i.is_dir()]
        size = sum(i.file_size for i in files)
        shown = ", ".join(i.filename for i in files[:3]) + (f", ... ({len(files) - 3} more)" if len(files) > 3 else "")
        print(f"dropped {glob}: {len(files)} file(s), {mib(size)} uncompressed ({shown})")
    a, b = src.stat().st_size, dst.stat().st_size
    print(f"{src.name}: {mib(a)} -> {mib(b)} ({a} -> {b} bytes); RECORD lists {len(rows)} entries")
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("wheel", type=Path, nargs="+", help="IN.whl OUT_DIR (strip), or the wheels to check (--check)")
    p.add_argument("--drop", action="append", default=[], metavar="GLOB", help="member paths to drop (repeatable)")
    p.add_argument("--check", action="store_true", help="only check each wheel's RECORD against its members")
    args = p.parse_args(argv)
    if args.check:
        if args.drop:
            p.error("--check takes no --drop")
        bad = 0
        for wheel in args.wheel:
            problems = check_record(wheel)
            for problem in problems:
                print(f"{wheel.name}: {problem}")
            print(f"{wheel.name}: RECORD {'has ' + str(len(problems)) + ' problem(s)' if problems else 'consistent'}")
            bad += bool(problems)
        return 1 if bad else 0
    if len(args.wheel) != 2 or not args.drop:
        p.error("usage: strip_wheel.py IN.whl OUT_DIR --drop GLOB [--drop GLOB ...]")
    src, out_dir = args.wheel
    dst = strip(src, out_dir, args.drop)
    problems = check_record(dst)
    if problems:  # a bug here, not in the input: say so rather than hand on a wheel pip would refuse
        print("\n".join(problems), file=sys.stderr)
        dst.unlink()
        return 1
    print(f"{dst}: RECORD consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
