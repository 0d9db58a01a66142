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
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
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


async def test_the_live_documents_are_streamed_as_of_the_seq_asked(tmp_path):
    """What the builder indexes: each live document's last write up to `upto_seq`, a
    delete dropping it, later writes not seen (read twice: the corpus is never held)."""
    from ragline_services.retrieval.documents import encode_vector
    from ragline_services.retrieval.wal import WriteLog, live_documents

    log = WriteLog(tmp_path / "write.log")

    def doc(doc_id: str, text: str) -> dict:
        return {
            "tenant": "acme",
            "id": doc_id,
            "title": "",
            "text": text,
            "acl": [],
            "attributes": {},
            "vector": encode_vector([0.1, 0.2]),
            "version": 0,
            "model": "m",
        }

    for upserts, deletes in (
        ([doc("a", "a1"), doc("b", "b1")], []),  # 1
        ([doc("a", "a2")], []),  # 2
        ([], ["acme\x1fb"]),  # 3
        ([doc("b", "b2"), doc("c", "c1")], []),  # 4
        ([doc("a", "a3")], []),  # 5: after the seq asked
    ):
        await log.append_numbered(
            {"op": "write", "tenant": "acme", "upserts": upserts, "deletes": deletes}
        )
    seen = {d.key.split("\x1f")[1]: d.text for d in live_documents(log.path, 4)}
    assert seen == {"a": "a2", "b": "b2", "c": "c1"}
    assert {d.text for d in live_documents(log.path, 3)} == {"a2"}
    log.close()
