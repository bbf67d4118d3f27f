"""config/panels.py is the one table of which task each flag belongs to: every flag sits in exactly one panel,
a first run's flags have a one-line help, and docs/flags.md documents every flag under the same panels."""

import re
from collections import Counter
from pathlib import Path

from orlhf.config.flags import flag_fields
from orlhf.config.panels import COMMAND_FLAGS, FIRST_RUN, PANELS, ordered_flags

DOCS = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
FIRST_RUN_PANELS = ["Model and data", "Rewards", "Algorithm", "Rollout", "Placement and device", "Output and logging"]


def test_every_flag_has_exactly_one_panel():
    counts = Counter(ordered_flags())
    assert [flag for flag, n in counts.items() if n > 1] == []
    flags = {name for _, name, _, _ in flag_fields()} | set(COMMAND_FLAGS)
    assert set(counts) == flags, (flags - set(counts), set(counts) - flags)


def test_first_run_panels_come_first_and_hold_every_first_run_flag():
    assert [p.title for p in PANELS[: len(FIRST_RUN_PANELS)]] == FIRST_RUN_PANELS
    assert all(not p.first_run for p in PANELS[len(FIRST_RUN_PANELS) :])
    assert 30 <= len(FIRST_RUN) <= 45


def test_no_panel_is_a_catch_all():
    assert max(len(p.flags) for p in PANELS) <= 25


def test_first_run_flags_have_a_one_line_help():
    helps = {name: f.metadata["help"] for _, name, f, _ in flag_fields()}
    for flag, line in FIRST_RUN.items():
        text = line or helps.get(flag)
        if flag in COMMAND_FLAGS:
            continue  # cli.py declares its help
        assert len(text) <= 130 and text.count(". ") == 0, (flag, text)


def documented_flags(doc: str) -> set[str]:
    names = set(re.findall(r"--([a-z0-9_]+)", doc))
    for roles, rest in re.findall(r"--\{([a-z,]+)\}(_[a-z0-9_]+)", doc):  # --{actor,critic}_num_nodes
        names |= {role + rest for role in roles.split(",")}
    return names


def test_docs_document_every_flag_under_its_panel():
    doc = DOCS.read_text()
    assert {*ordered_flags()} - documented_flags(doc) == set()
    sections = re.split(r"^## ", doc, flags=re.M)
    by_title = {s.splitlines()[0].strip(): s for s in sections[1:]}
    for panel in PANELS:
        assert panel.title in by_title, panel.title
        missing = {*panel.flags} - documented_flags(by_title[panel.title])
        assert not missing, (panel.title, missing)
