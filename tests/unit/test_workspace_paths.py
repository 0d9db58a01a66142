"""Every repository path WORKSPACE.md names exists (a moved or renamed file is fixed in
the map the same day)."""

from __future__ import annotations

import re

from support import REPO_ROOT

TOP = ("app", "clients", "deploy", "docs", "libs", "proto", "services", "tests", "tools")
# `libs/ragline/batching.py`, `deploy/k8s/helm/ragline/values.yaml`, `tests/unit`, ...
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP) + r")/[\w./-]+)")


def named_paths(text: str) -> set[str]:
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,:;)")
        if any(mark in text[match.end() : match.end() + 1] for mark in "<*{"):
            continue  # a pattern (`services/<name>/...`), not a path
        found.add(path)
    return found


def test_every_path_workspace_md_names_exists():
    missing = sorted(
        p
        for p in named_paths((REPO_ROOT / "WORKSPACE.md").read_text())
        if not (REPO_ROOT / p).exists()
    )
    assert not missing, f"WORKSPACE.md names paths that do not exist: {missing}"


def test_the_check_finds_a_path_that_does_not_exist():
    text = (
        "`MicroBatcher` (services/ragline_services/embedding/batcher.py) and "
        "libs/ragline/batching.py."
    )
    assert named_paths(text) == {
        "services/ragline_services/embedding/batcher.py",
        "libs/ragline/batching.py",
    }
    assert not (REPO_ROOT / "services/ragline_services/embedding/batcher.py").exists()
