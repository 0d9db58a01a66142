"""The type checker of `make lint`: mypy over the kit (`ragline`), the services
(`ragline_services`) and the application (`ragline_app`), as they import each other.

    .venv/bin/python tools/typecheck.py      # fails on any error, printed as repo paths

Each package's folder is named as it is imported (libs/ragline, services/ragline_services,
app/ragline_app), so mypy finds them on its search path (`mypy_path`: libs, services, app)
as they are. The settings are pyproject.toml's `[tool.mypy]`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")


def run_mypy() -> list[tuple[str, int, str]]:
    """(repository path, line, message) of every error."""
    ran = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--no-error-summary", "--show-error-codes", "--hide-error-context",
         "-p", "ragline", "-p", "ragline_services", "-p", "ragline_app"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    errors = []
    for line in ran.stdout.splitlines():
        found = _ERROR.match(line)
        if found:
            errors.append((found["path"], int(found["line"]), found["message"]))
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
