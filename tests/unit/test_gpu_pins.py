"""The `gpu` extra's pins resolve together for Linux x86_64 with CUDA, checked without installing anything.

Metadata only, in seconds: the index's project JSON says whether the pinned vLLM and torch have Linux x86_64
wheels, and the METADATA inside vLLM's wheel (read by HTTP range requests, not downloaded) says whether its
requirements admit orlhf's pins (its torch pin must be ours; every package both vLLM and orlhf's core constrain,
transformers included, must have a release both accept). Skipped, saying why, when the index cannot be reached. The
full transitive resolution (pip --dry-run over the whole stack, minutes) runs with ORLHF_FULL_RESOLVE=1.
"""

import importlib.metadata
import io
import json
import os
import runpy
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[2]
PINS = runpy.run_path(str(ROOT / "orlhf" / "versions.py"))
INDEX = os.environ.get("ORLHF_PYPI_JSON", "https://pypi.org/pypi")
# A CUDA machine as the gpu extra targets: Linux x86_64, CPython 3.11 (the version the CPU stack is tested on)
LINUX_X86_64 = {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


def _get(url: str, headers: dict | None = None) -> bytes:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=15) as r:
            return r.read()
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        pytest.skip(f"package index unreachable ({url}: {e}); the pins were not checked")


def project(name: str) -> dict:
    """The index's project JSON (every release and its files)."""
    return json.loads(_get(f"{INDEX}/{name}/json"))


class _RangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests: zipfile needs only the wheel's tail and one member."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        data = _get(self.url, {"Range": f"bytes={self.pos}-{self.pos + n - 1}"})[:n]
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def linux_wheel(name: str, version: str) -> dict | None:
    """The release's Linux x86_64 (or pure-Python) wheel file entry, if it has one."""
    files = project(name)["releases"].get(version, [])
    wheels = [f for f in files if f["filename"].endswith(".whl")]
    return next((f for f in wheels if "x86_64" in f["filename"] and "linux" in f["filename"]), None) or next(
        (f for f in wheels if f["filename"].endswith("-none-any.whl")), None
    )


def requirements(name: str, version: str) -> list[Requirement]:
    """Requires-Dist of the release's wheel for Linux x86_64, read from the wheel's METADATA by range requests
    (about 100 kB of a 300 MB wheel), with the markers evaluated for that platform."""
    wheel = linux_wheel(name, version)
    assert wheel is not None, f"{name} {version} has no Linux x86_64 wheel"
    url = urllib.parse.urljoin(f"{INDEX}/{name}/json", wheel["url"])  # mirrors may give relative links
    with zipfile.ZipFile(io.BufferedReader(_RangeFile(url, wheel["size"]), 1 << 16)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [
        Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")
    ]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LINUX_X86_64)]


def releases(name: str) -> list[Version]:
    out = []
    for v in project(name)["releases"]:
        try:
            out.append(Version(v))
        except InvalidVersion:
            pass
    return out


def pinned_core() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PINS["CORE"]]
    return {canonicalize_name(r.name): r for r in reqs}


def test_gpu_extra_resolves_for_linux_x86_64_cuda():
    extra = {canonicalize_name(Requirement(r).name): Requirement(r) for r in PINS["EXTRAS"]["gpu"]}
    vllm_version = str(next(iter(extra["vllm"].specifier)).version)
    assert linux_wheel("torch", PINS["TORCH"]) is not None, f"torch {PINS['TORCH']} has no Linux x86_64 wheel"
    torch_version = Version(PINS["TORCH"])
    core = pinned_core()
    problems = []
    for req in requirements("vllm", vllm_version):
        name = canonicalize_name(req.name)
        if name == "torch":
            if torch_version not in req.specifier:
                problems.append(f"vllm {vllm_version} needs {req}, orlhf pins torch=={torch_version}")
        elif name in core:
            ours = core[name].specifier
            both = [v for v in releases(name) if v in ours and v in req.specifier]
            if not both:
                problems.append(f"no {name} release satisfies vllm's {req.specifier} and orlhf's {ours}")
    # DeepSpeed is an sdist on the index (no wheel metadata to read): its requirements from this installation
    if importlib.metadata.version("deepspeed") == PINS["DEEPSPEED"]:
        for req in map(Requirement, importlib.metadata.requires("deepspeed") or []):
            if canonicalize_name(req.name) == "torch" and torch_version not in req.specifier:
                problems.append(f"deepspeed {PINS['DEEPSPEED']} needs {req}, orlhf pins torch=={torch_version}")
    # the other packages of the extra (bitsandbytes): the newest allowed release has a Linux wheel that takes our torch
    for name, req in extra.items():
        if name == "vllm":
            continue
        newest = max(v for v in releases(name) if v in req.specifier and not v.is_prerelease)
        for dep in requirements(name, str(newest)):
            if canonicalize_name(dep.name) == "torch" and torch_version not in dep.specifier:
                problems.append(f"{name} {newest} needs {dep}, orlhf pins torch=={torch_version}")
    assert not problems, problems


@pytest.mark.skipif(
    os.environ.get("ORLHF_FULL_RESOLVE") != "1",
    reason="full pip resolution takes minutes; set ORLHF_FULL_RESOLVE=1 to run it",
)
def test_gpu_extra_full_pip_resolution(tmp_path):
    platforms = [a for i in range(17, 36) for a in ("--platform", f"manylinux_2_{i}_x86_64")]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--isolated",
        "--dry-run",
        "--ignore-installed",
        "-q",
        "--target",
        str(tmp_path / "t"),
        "--report",
        str(tmp_path / "r.json"),
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--implementation",
        "cp",
        *platforms,
        "--platform",
        "manylinux2014_x86_64",
        *PINS["EXTRAS"]["gpu"],
        f"torch=={PINS['TORCH']}",
        f"transformers{PINS['TRANSFORMERS']}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = {
        i["metadata"]["name"]: i["metadata"]["version"]
        for i in json.loads((tmp_path / "r.json").read_text())["install"]
    }
    assert installed["torch"] == PINS["TORCH"] and installed["vllm"] == PINS["VLLM_GPU"]
