"""Every setting a ragline process reads is in WORKSPACE.md's configuration tables."""

from __future__ import annotations

import re

from ragline.auth import AuthConfig
from ragline.config import CommonConfig, ServiceConfig
from ragline_services.registry import load_spec, service_names
from support import REPO_ROOT


def settings() -> list[str]:
    names = [f"RAGLINE_{field.upper()}" for field in CommonConfig.model_fields]
    names += [f"RAGLINE_AUTH_{field.upper()}" for field in AuthConfig.model_fields]
    shared = set(ServiceConfig.model_fields)
    for service in service_names():
        config = load_spec(service).config_factory
        names += [
            f"RAGLINE_{service.upper()}_{field.upper()}"
            for field in config.model_fields
            if field not in shared
        ]
    return names


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
