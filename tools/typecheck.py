"""The type checker of `make lint`: mypy over the kit (`ragline`), the services
(`ragline_services`) and the application (`ragline_app`), as they import each other.

    .venv/bin/python tools/typecheck.py      # fails on any error, printed as repo paths

The packages' folders are not named as they are imported (`services/` is
`ragline_services`), so mypy reads them through a folder of links named as the packages,
under build/typecheck. The settings are pyproject.toml's `[tool.mypy]`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINKS = {
    "ragline": REPO / "libs" / "ragline",
    "ragline_services": REPO / "services",
    "ragline_app": REPO / "app",
}
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")


def link_tree(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, target in LINKS.items():
        link = root / name
        if link.is_symlink() and link.resolve() == target:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return root


def repo_path(path: str) -> str:
    """A path as mypy printed it (through a link) as the repository names it."""
    package, _, rest = path.partition("/")
    target = LINKS.get(package)
    return str((target / rest).relative_to(REPO)) if target else path


def run_mypy() -> list[tuple[str, int, str]]:
    """(repository path, line, message) of every error."""
    root = link_tree(REPO / "build" / "typecheck")
    ran = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--no-error-summary", "--show-error-codes", "--hide-error-context",
         "-p", "ragline", "-p", "ragline_services", "-p", "ragline_app"],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    errors = []
    for line in ran.stdout.splitlines():
        found = _ERROR.match(line)
        if found:
            errors.append((repo_path(found["path"]), int(found["line"]), found["message"]))
    if ran.returncode not in (0, 1) or (ran.returncode == 1 and not errors):
        raise SystemExit(f"typecheck: mypy failed to run:\n{ran.stdout}{ran.stderr}")
    return errors


def main() -> int:
    errors = run_mypy()
    for path, line, message in errors:
        print(f"{path}:{line}: error: {message}")
    print(f"typecheck: {len(errors)} error(s)", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
