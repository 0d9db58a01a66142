"""Every setting a ragline process reads is in WORKSPACE.md's configuration tables."""

from __future__ import annotations

import re

from support import REPO_ROOT, settings


def documented(text: str) -> set[str]:
    """Variable names in the tables, with `..._SUFFIX` continuing the row's first name."""
    found = set()
    for row in text.splitlines():
        if not row.startswith("| `"):
            continue
        first = row.split("|")[1]
        names = re.findall(r"`(RAGLINE_[A-Z0-9_]+|\.\.\._[A-Z0-9_]+)`", first)
        prefix = ""
        for name in names:
            if name.startswith("RAGLINE_"):
                found.add(name)
                prefix = re.match(r"RAGLINE_[A-Z]+_", name).group(0)
            else:
                found.add(prefix + name.removeprefix("..._"))
    return found


def test_every_setting_is_documented():
    missing = set(settings()) - documented((REPO_ROOT / "WORKSPACE.md").read_text())
    assert not missing, f"settings missing from WORKSPACE.md: {sorted(missing)}"


def test_the_check_can_fail():
    table = "| `RAGLINE_GENERATION_TRITON_URL`, `..._TRITON_MODEL` | x | y |"
    assert documented(table) == {"RAGLINE_GENERATION_TRITON_URL", "RAGLINE_GENERATION_TRITON_MODEL"}
    assert "RAGLINE_EMBEDDING_MODEL" not in documented(table)
