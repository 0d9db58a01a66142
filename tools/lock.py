"""Writes constraints.txt: every package `make install` and `make install-test` put in the
virtualenv, at the version a fresh resolution chose, so that a new release upstream (a
linter's new rule, a library's changed default) changes nothing here until this is run
again and the tests pass on the result. `make install` installs under these constraints.

    .venv/bin/python tools/lock.py        # a few minutes: a fresh virtualenv, resolved anew

The resolution runs in a throwaway virtualenv with the same pip configuration, from
pyproject.toml's dependencies and its `test` and `export` extras.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"
HEADER = """\
# Every package of ragline's virtualenv (runtime, test and export extras) at the version
# last resolved and tested: `make install` installs under these constraints.
# Written by tools/lock.py (a fresh resolution); edit pyproject.toml, then run it.
"""


def resolve() -> list[str]:
    with tempfile.TemporaryDirectory(prefix="ragline-lock-") as folder:
        venv = Path(folder) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "install", "--quiet", "-e", f"{REPO}[test,export]"], check=True)
        frozen = subprocess.run(
            [*pip, "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
        ).stdout
    return sorted((line for line in frozen.splitlines() if "==" in line), key=str.lower)


def main() -> int:
    pins = resolve()
    CONSTRAINTS.write_text(HEADER + "".join(f"{pin}\n" for pin in pins))
    print(f"{CONSTRAINTS}: {len(pins)} packages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
