"""The type checker of `make lint`: mypy over the kit (`ragline`), the services
(`ragline_services`) and the application (`ragline_app`), as they import each other.

    .venv/bin/python tools/typecheck.py             # fails on an error not in the baseline
    .venv/bin/python tools/typecheck.py --update    # rewrites the baseline (only to shrink it)

The packages' folders are not named as they are imported (`services/` is
`ragline_services`), so mypy reads them through a folder of links named as the packages,
under build/typecheck. The settings are pyproject.toml's `[tool.mypy]`.

The baseline (tools/typecheck_baseline.txt) lists the errors the code had when the
checker was switched on, by file, error code and message (line numbers move with every
edit). It may only shrink: an error not in it fails, and so does an entry no longer
found (the fix is to take it out, with --update), so a fixed error cannot come back.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "tools" / "typecheck_baseline.txt"
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


def run_mypy() -> tuple[list[tuple[str, int, str]], str]:
    """(repository path, line, message) of every error, and mypy's whole output."""
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
    return errors, ran.stdout


def entry(path: str, message: str) -> str:
    return f"{path}: {message}"


def read_baseline() -> Counter[str]:
    if not BASELINE.exists():
        return Counter()
    lines = BASELINE.read_text(encoding="utf-8").splitlines()
    return Counter(line for line in lines if line and not line.startswith("#"))


def write_baseline(found: Counter[str]) -> None:
    header = (
        "# Type errors the code had when mypy joined `make lint` (tools/typecheck.py).\n"
        "# It may only shrink: fix one, then run `tools/typecheck.py --update`.\n"
    )
    BASELINE.write_text(header + "".join(f"{e}\n" for e in sorted(found.elements())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline")
    args = parser.parse_args()
    errors, _ = run_mypy()
    found = Counter(entry(path, message) for path, _, message in errors)
    baseline = read_baseline()
    if args.update:
        grown = found - baseline
        if grown and baseline:
            print("typecheck: the baseline only shrinks; fix these first:", file=sys.stderr)
            for path, line, message in errors:
                if entry(path, message) in grown:
                    print(f"  {path}:{line}: {message}", file=sys.stderr)
            return 1
        write_baseline(found)
        print(f"typecheck: baseline rewritten, {sum(found.values())} known errors")
        return 0
    new, gone = found - baseline, baseline - found
    for path, line, message in errors:
        if new[entry(path, message)] > 0:
            print(f"{path}:{line}: error: {message}")
    for stale in sorted(gone.elements()):
        print(f"fixed, take it out of the baseline (--update): {stale}")
    known = sum((found & baseline).values())
    print(
        f"typecheck: {sum(new.values())} new error(s), {sum(gone.values())} fixed and still "
        f"in the baseline, {known} known",
        file=sys.stderr,
    )
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
