"""Child processes of a service, read from /proc (tests of what outlives what)."""

from __future__ import annotations

import time
from pathlib import Path


def children(parent: int, marker: bytes) -> list[int]:
    """Pids whose parent is `parent` and whose command line holds `marker`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == parent and marker in cmdline:
            found.append(int(stat.parent.name))
    return found


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, D, Z, ...); None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def gone(pid: int) -> bool:
    """No such process, or only its zombie (it has exited; nobody reaped it yet)."""
    return _state(pid) in (None, "Z", "X")


def all_gone(pids: list[int], timeout_s: float) -> bool:
    return seconds_until_gone(pids, timeout_s) is not None


def seconds_until_gone(pids: list[int], timeout_s: float) -> float | None:
    """How long until every one of `pids` is gone; None if some are still there after
    `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() < start + timeout_s:
        if all(gone(pid) for pid in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    return time.monotonic() - start if all(gone(pid) for pid in pids) else None


def states(pids: list[int]) -> dict[int, str]:
    """Each pid's state and what it waits in (for a message when one lingers)."""
    found = {}
    for pid in pids:
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            wchan = ""
        found[pid] = f"{_state(pid) or 'gone'} {wchan}".strip()
    return found
