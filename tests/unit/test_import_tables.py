"""transformers' lazy-module tables and its package-to-distribution map from their cache files
(orlhf/storage/import_tables.py): the same as transformers builds, built again when a file they come from changes,
transformers' own build when the cache cannot be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orlhf.storage import import_tables
from orlhf.storage.import_tables import cached_packages, cached_tables, patch_when_imported

ROOT = Path(__file__).resolve().parents[2]


class Builds:
    """A define_import_structure stand-in that counts its calls."""

    def __init__(self, table):
        self.table, self.calls = table, 0

    def __call__(self, module_path, prefix=None):
        self.calls += 1
        return self.table


TABLE = {frozenset(): {"a.configuration_a": {"AConfig"}}, frozenset({"torch"}): {"a.modeling_a": {"AModel", "B"}}}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("ORLHF_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "models"
    (models / "a").mkdir(parents=True)
    (models / "__init__.py").write_text("")
    (models / "a" / "modeling_a.py").write_text("__all__ = ['AModel', 'B']\n")
    return models


def test_built_once_then_read_until_a_file_changes(folder):
    build = Builds(TABLE)
    first = cached_tables(build, folder / "__init__.py", None, "5.0")
    again = cached_tables(build, folder / "__init__.py", None, "5.0")
    assert first == again == TABLE and build.calls == 1
    assert again is not TABLE  # a fresh table each time: transformers' lazy module may change what it is given

    (folder / "a" / "modeling_a.py").write_text("__all__ = ['AModel', 'B', 'C']\n")  # an edited file
    cached_tables(build, folder / "__init__.py", None, "5.0")
    assert build.calls == 2
    (folder / "a" / "new_a.py").write_text("")  # a new file
    cached_tables(build, folder / "__init__.py", None, "5.0")
    assert build.calls == 3
    cached_tables(build, folder / "__init__.py", None, "5.1")  # another transformers
    assert build.calls == 4
    cached_tables(build, folder / "__init__.py", "models", "5.1")  # another prefix: its own table
    assert build.calls == 5
    cached_tables(build, folder, "models", "5.1")  # the folder itself: the same table as its __init__.py's
    assert build.calls == 5


def test_unusable_cache_leaves_transformers_build(folder, monkeypatch, tmp_path):
    build = Builds(TABLE)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("ORLHF_CACHE", str(blocker))  # the cache folder cannot be made
    assert cached_tables(build, folder, None, "5.0") == TABLE
    assert cached_tables(build, folder, None, "5.0") == TABLE and build.calls == 2

    monkeypatch.setenv("ORLHF_CACHE", str(tmp_path / "cache2"))
    odd = {frozenset({("torch", ">=2")}): {"a.modeling_a": {"AModel"}}}  # a shape JSON cannot carry: not cached
    build = Builds(odd)
    assert cached_tables(build, folder, None, "5.0") is odd
    assert cached_tables(build, folder, None, "5.0") is odd and build.calls == 2

    def no_cache_folder():
        raise RuntimeError("no home folder")

    monkeypatch.setattr("orlhf.demo.builder.default_cache_dir", no_cache_folder)
    build = Builds(TABLE)
    assert cached_tables(build, folder, None, "5.0") == TABLE and build.calls == 1
    monkeypatch.undo()
    monkeypatch.setenv("ORLHF_CACHE", str(tmp_path / "cache2"))

    build = Builds(TABLE)
    cached_tables(build, folder, None, "5.0")
    [stored] = (tmp_path / "cache2" / import_tables.FOLDER).glob("*.json")
    stored.write_text("{not json")  # a damaged cache file: built again, and written whole
    assert cached_tables(build, folder, None, "5.0") == TABLE and build.calls == 2
    assert json.loads(stored.read_text())["table"]
    assert cached_tables(build, folder, None, "5.0") == TABLE and build.calls == 2


def test_patch_runs_after_the_module_is_first_imported(tmp_path, monkeypatch):
    (tmp_path / "orlhf_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    patch_when_imported("orlhf_probe_mod", lambda: seen.append(sys.modules["orlhf_probe_mod"].VALUE))
    assert not seen
    import orlhf_probe_mod  # noqa: F401

    assert seen == [1]
    patch_when_imported("orlhf_probe_mod", lambda: seen.append(2))  # imported already: at once
    assert seen == [1, 2]
    del sys.modules["orlhf_probe_mod"]


def test_distributions_computed_once_then_read_until_an_install_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("ORLHF_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    calls = []

    def build():
        calls.append(1)
        return {"pkg": ["Dist"], "other": ["Dist", "Fork"]}

    first = cached_packages(build)
    assert first == cached_packages(build) == build() and len(calls) == 2  # once cached, then read
    info = site / "new_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: new-dist\n")  # a distribution installed
    cached_packages(build)
    assert len(calls) == 3
    (info / "top_level.txt").write_text("new_dist\n")  # what it provides, changed
    cached_packages(build)
    assert len(calls) == 4 and cached_packages(build) == first and len(calls) == 4
    monkeypatch.syspath_prepend(str(tmp_path))  # another sys.path
    cached_packages(build)
    assert len(calls) == 5

    class Finder:  # another source of distributions: never cached
        def find_spec(self, *a, **k):
            return None

        def find_distributions(self, *a, **k):
            return iter(())

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    cached_packages(build), cached_packages(build)
    assert len(calls) == 7


def test_distributions_only_while_the_module_runs():
    import importlib.metadata as metadata

    own = metadata.packages_distributions
    with import_tables.cached_distributions():
        assert metadata.packages_distributions is not own
        inside = metadata.packages_distributions()
    assert metadata.packages_distributions is own and inside == own()


CHILD = r"""
import json, sys
if sys.argv[1] == "cached":
    from orlhf.storage.import_tables import install
    install()
import transformers, transformers.models, transformers.models.llama
import transformers.utils.import_utils as iu
from transformers import AutoTokenizer, LlamaForCausalLM  # the lazy modules at work


def state(m):  # what transformers' lazy module made of its table
    return {"modules": sorted(m._modules), "class_to_module": sorted(m._class_to_module.items()),
            "missing": sorted((k, sorted(map(str, v))) for k, v in m._object_missing_backend.items()),
            "all": sorted(m.__all__)}


names = ("transformers", "transformers.models", "transformers.models.llama")
print(json.dumps({"cached": getattr(iu.define_import_structure, "_orlhf_cached", False),
                  "state": {n: state(sys.modules[n]) for n in names},
                  "distributions": sorted(iu.PACKAGE_DISTRIBUTION_MAPPING.items())}))
"""


def test_transformers_lazy_modules_are_the_same_with_the_cached_tables(tmp_path):
    env = {**os.environ, "ORLHF_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def child(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    own = child("plain")
    assert not own["cached"] and not (tmp_path / import_tables.FOLDER).exists()
    built, read = child("cached"), child("cached")  # the first builds and writes the tables, the second reads them
    assert built["cached"] and read["cached"]
    assert built["state"] == own["state"] and read["state"] == own["state"]
    assert built["distributions"] == own["distributions"] == read["distributions"] != []
    stored = [p.name for p in (tmp_path / import_tables.FOLDER).glob("*.json")]
    assert len([n for n in stored if n.startswith("distributions-")]) == 1
    assert len(stored) >= 4  # transformers', models', llama's tables, and the distributions
