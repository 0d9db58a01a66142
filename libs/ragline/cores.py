"""How many cores this process may use: its CPU affinity, capped by a container's CPU limit.

Thread and runner counts ("0 = the cores") must follow what a pod was granted, not the
node's core count: a pod limited to 2 CPUs on a 64-core node that starts 64 threads is
throttled, not faster. The limit is read from the cgroup (v2 `cpu.max`, v1 the CFS quota);
a fractional limit rounds down, never below one core.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU limit in cores, or None when there is none (or none readable)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # v1: -1 = none
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cores(root: Path = CGROUP_ROOT) -> int:
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # not Linux
        cores = os.cpu_count() or 1
    limit = cpu_limit(root)
    if limit is not None:
        cores = min(cores, int(limit))
    return max(1, cores)


def parallel_runs(configured: int, threads_per_run: int) -> int:
    """Model runs a process keeps at once: `configured`, or (0) one per `threads_per_run`
    of the cores it may use, at least one."""
    return configured or max(1, usable_cores() // threads_per_run)


def limit_blas_threads(threads: int) -> int | None:
    """Caps the threads of every BLAS library loaded in this process (numpy's OpenBLAS) at
    `threads` (0 leaves them as they are); returns the cap now in force, None when no BLAS
    is loaded or nothing was changed."""
    if threads <= 0:
        return None
    from threadpoolctl import threadpool_info, threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
    counts = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    return max(counts) if counts else None
