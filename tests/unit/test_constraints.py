"""constraints.txt pins every dependency pyproject.toml names (runtime, test and export
extras), exactly, at a version its specifier allows: a release upstream changes nothing
here until tools/lock.py resolves again."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from support import REPO_ROOT


def pins() -> dict[str, Version]:
    out = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            out[canonicalize_name(name)] = Version(version)
    return out


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    named = [*project["dependencies"]]
    for extra in ("test", "export"):
        named += project["optional-dependencies"][extra]
    return [Requirement(text) for text in named]


def test_every_dependency_is_pinned_at_a_version_it_allows():
    pinned = pins()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is not in constraints.txt: run tools/lock.py"
        version = pinned[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"constraints.txt pins {requirement.name}=={version}, outside {requirement}: "
            "run tools/lock.py"
        )
