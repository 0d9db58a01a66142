"""Every check docs/security.md names exists (a claim must point at a test that runs)."""

from __future__ import annotations

import re

from support import REPO_ROOT


def test_every_check_named_in_the_security_page_exists():
    text = (REPO_ROOT / "docs" / "security.md").read_text()
    references = re.findall(r"`(?:pytest )?(tests/[\w/.]+)(?:::(\w+))?`", text)
    assert references
    for path, name in references:
        target = REPO_ROOT / path
        assert target.exists(), path
        if name:
            assert re.search(rf"def {name}\(", target.read_text()), f"{path}::{name}"
