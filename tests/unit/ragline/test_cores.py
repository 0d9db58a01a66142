"""Core counts follow a container's CPU limit, not the node's cores."""

from __future__ import annotations

import os

from ragline.cores import cpu_limit, parallel_runs, usable_cores


def test_no_cgroup_means_the_affinity(tmp_path):
    assert cpu_limit(tmp_path) is None
    assert usable_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_cgroup_v2_limit_caps_and_rounds_down(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_limit(tmp_path) == 1.5
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_limit(tmp_path) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limit(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert usable_cores(tmp_path) == 1  # half a core still runs one thread


def test_a_limit_above_the_affinity_changes_nothing(tmp_path):
    (tmp_path / "cpu.max").write_text("6400000 100000\n")
    assert usable_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_parallel_runs_is_the_setting_or_one_per_threads_of_the_cores():
    assert parallel_runs(3, 1) == 3
    assert parallel_runs(0, 1) == usable_cores()
    assert parallel_runs(0, usable_cores() + 1) == 1  # never none


BLAS_PROBE = """
import json, sys
import numpy
from threadpoolctl import threadpool_info
from ragline.cores import limit_blas_threads

def blas():
    return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

out = {"before": blas(), "zero": limit_blas_threads(0), "after_zero": blas()}
out["three"] = limit_blas_threads(3)
out["one"] = limit_blas_threads(1)
out["after_one"] = blas()
print(json.dumps(out))
"""


def test_blas_threads_are_capped_in_a_fresh_process():
    # A process of its own: the cap is process-wide and must not leak into other tests.
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    probe = subprocess.run(
        [sys.executable, "-c", BLAS_PROBE], env=env, capture_output=True, text=True, check=True
    )
    seen = json.loads(probe.stdout)
    assert seen["before"], "numpy loaded no BLAS that threadpoolctl can see"
    assert seen["zero"] is None and seen["after_zero"] == seen["before"]  # 0 leaves it
    assert seen["three"] == 3  # the cap is really applied, not just reported
    assert seen["one"] == 1 and seen["after_one"] == [1] * len(seen["before"])
