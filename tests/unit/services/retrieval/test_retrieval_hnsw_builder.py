"""The HNSW builder's CPU priority: every thread of the builder process, those started
before it lowered its priority included, ends up in Linux's idle class at the niceness
asked (run in a child process: the test's own process keeps its priority)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, threading
from ragline_services.retrieval.hnsw_builder import lower_priority
started, release = threading.Event(), threading.Event()
tids = []
def early():
    tids.append(threading.get_native_id()); started.set(); release.wait()
threading.Thread(target=early).start()  # like a BLAS pool started at import
started.wait()
mode = lower_priority(19, {idle})
def seen(tid):
    return [os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)]
late = []
t = threading.Thread(target=lambda: late.append(seen(0)))  # started after: inherits it
t.start(); t.join()
threads = [seen(threading.get_native_id()), seen(tids[0]), late[0]]
release.set()
print(json.dumps({{"mode": mode, "threads": threads}}))
"""


def probe(idle: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(idle=idle)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_every_builder_thread_runs_in_the_idle_class_at_the_niceness_asked():
    seen = probe(idle=True)
    assert seen["mode"] == "idle"
    assert seen["threads"] == [[os.SCHED_IDLE, 19]] * 3


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_without_the_idle_class_the_threads_keep_the_normal_class_at_the_niceness():
    seen = probe(idle=False)
    assert seen["mode"] == "normal"
    assert seen["threads"] == [[os.SCHED_OTHER, 19]] * 3
