from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from ragline_services.retrieval import wal
from ragline_services.retrieval.wal import CorruptLog, WriteLog


async def test_append_replay_and_reopen(tmp_path):
    log = WriteLog(tmp_path / "log")
    seqs = [await log.append({"op": "upsert", "n": i}) for i in range(3)]
    assert seqs == [1, 2, 3]
    assert [r["n"] for r in log.replay(after_seq=1)] == [1, 2]
    log.close()
    reopened = WriteLog(tmp_path / "log")
    assert reopened.last_seq == 3
    assert await reopened.append({"op": "delete"}) == 4


async def test_concurrent_appends_share_fsyncs_and_keep_order(tmp_path, monkeypatch):
    import os

    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    log = WriteLog(tmp_path / "log")
    calls.clear()
    seqs = await asyncio.gather(*(log.append({"n": i}) for i in range(50)))
    assert sorted(seqs) == list(range(1, 51))
    assert len(calls) < 50  # group commit
    assert [r["seq"] for r in log.replay()] == list(range(1, 51))


async def test_torn_and_corrupt_tails_are_cut(tmp_path):
    path = tmp_path / "log"
    log = WriteLog(path)
    for i in range(3):
        await log.append({"n": i})
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # a crash mid-append: record 3 was never acknowledged
    reopened = WriteLog(path)
    assert reopened.last_seq == 2 and [r["n"] for r in reopened.replay()] == [0, 1]
    assert await reopened.append({"n": "after"}) == 3
    reopened.close()
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF  # flip a byte of the last payload: its checksum fails
    path.write_bytes(bytes(data))
    assert WriteLog(path).last_seq == 2


async def test_a_cancelled_caller_does_not_cancel_the_write(tmp_path):
    log = WriteLog(tmp_path / "log")
    task = asyncio.create_task(log.append({"n": 1}))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.sleep(0.2)
    assert [r["n"] for r in log.replay()] == [1]


async def test_corruption_in_the_middle_stops_the_open_and_repair_keeps_every_good_record(
    tmp_path,
):
    path = tmp_path / "log"
    log = WriteLog(path)
    for i in range(5):
        await log.append({"n": i})
    log.close()
    frames = list(WriteLog.read(path))
    data = bytearray(path.read_bytes())
    second = len(json.dumps(frames[0], separators=(",", ":"))) + 8  # start of record 2
    data[second + 10] ^= 0xFF  # damage record 2's payload: records 3-5 are good after it
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLog) as caught:
        WriteLog(path)
    assert caught.value.last_seq == 1 and "wal repair" in str(caught.value)
    assert path.read_bytes() == bytes(data)  # nothing was cut

    said = wal.repair(path)
    assert "records lost to the damage: [2]" in said
    repaired = WriteLog(path)
    assert [r["n"] for r in repaired.replay()] == [0, 2, 3, 4]
    assert repaired.last_seq == 5 and await repaired.append({"n": 5}) == 6
    assert list(tmp_path.glob("log.damaged-*"))


async def test_no_append_is_acknowledged_before_its_fsync_returns(tmp_path):
    released = threading.Event()
    synced = []

    def slow_fsync(fd):
        released.wait(5)
        os.fsync(fd)
        synced.append(fd)

    log = WriteLog(tmp_path / "log", fsync=slow_fsync)
    append = asyncio.create_task(log.append({"n": 1}))
    await asyncio.sleep(0.2)
    assert not append.done()  # the write is in the file, the fsync has not returned
    released.set()
    assert await append == 1 and synced


async def test_short_writes_are_completed_before_the_fsync(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    log = WriteLog(tmp_path / "log")
    await asyncio.gather(*(log.append({"n": i, "text": "x" * 100}) for i in range(10)))
    log.close()
    monkeypatch.undo()
    assert [r["n"] for r in WriteLog(tmp_path / "log").replay()] == list(range(10))


def test_a_new_log_and_a_replaced_state_file_are_durable_in_their_directory(tmp_path, monkeypatch):
    from ragline import files

    synced = []
    monkeypatch.setattr(wal, "fsync_directory", lambda d: synced.append(("wal", d)))
    WriteLog(tmp_path / "log").close()
    assert synced == [("wal", tmp_path)]
    WriteLog(tmp_path / "log").close()  # opened again: nothing new in the directory
    assert len(synced) == 1

    events = []
    monkeypatch.setattr(files.os, "fsync", lambda fd: events.append("fsync file"))
    monkeypatch.setattr(files, "fsync_directory", lambda d: events.append("fsync dir"))
    real_replace = files.os.replace
    monkeypatch.setattr(
        files.os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b))
    )
    files.atomic_write_text(tmp_path / "state.json", "{}")
    assert events == ["fsync file", "rename", "fsync dir"]
    assert (tmp_path / "state.json").read_text() == "{}"


async def test_a_long_torn_tail_is_crossed_in_linear_time(tmp_path, monkeypatch):
    path = tmp_path / "log"
    log = WriteLog(path)
    await log.append({"n": 0})
    log.close()
    # A crash left a megabyte of zeros and noise after the last good frame (a preallocated
    # block, a torn write): every byte of it is a possible frame start.
    path.write_bytes(path.read_bytes() + bytes(1 << 20) + b"no frame here {" * 1000)
    tried = []
    real = wal._frame_at
    monkeypatch.setattr(wal, "_frame_at", lambda data, at: tried.append(at) or real(data, at))
    reopened = WriteLog(path)
    assert reopened.last_seq == 1
    # Only offsets before a "{" were tried (1,000 of them), not one per byte.
    assert len(tried) < 2_000, len(tried)
    reopened.close()


def _doc(doc_id: str, text: str) -> dict:
    return {"tenant": "acme", "id": doc_id, "title": "", "text": text, "acl": [], "version": 0}


async def test_compaction_keeps_what_a_replay_needs_and_forgets_the_rest(tmp_path):
    path = tmp_path / "write.log"
    log = WriteLog(path)

    async def write(upserts=(), deletes=()):
        record = {
            "op": "write",
            "tenant": "acme",
            "upserts": list(upserts),
            "deletes": list(deletes),
        }
        return await log.append_numbered(record)

    await write([_doc("a", "alpha secret"), _doc("b", "bravo secret")])  # seq 1
    await write([_doc("a", "alpha now")])  # seq 2: overwrites a
    await write(deletes=["acme\x1fb"])  # seq 3: deletes b
    await write([_doc("c", "charlie")])  # seq 4
    await log.append_numbered({"op": "write", "tenant": "globex", "upserts": [], "deletes": []})

    # The indexes hold up to seq 2: b's delete (seq 3) may still have to be replayed.
    before, after, dropped, forgotten = await asyncio.to_thread(log.compact, 2)
    assert after < before and dropped == 2  # seq 1 (both superseded) and the empty seq 5
    assert forgotten == {"acme"}  # whose deleted or overwritten text left the log
    data = path.read_bytes()
    assert b"alpha secret" not in data and b"bravo secret" not in data
    records = [r for r in WriteLog.read(path) if r.get("op") == "write"]
    assert [(r["seq"], r["tseq"]) for r in records] == [(2, 2), (3, 3), (4, 4)]
    assert records[1]["deletes"] == ["acme\x1fb"]  # a tombstone an index may still need

    # Once every index holds the delete, it goes too; numbering carries on.
    await asyncio.to_thread(log.compact, 5)
    assert [r["seq"] for r in WriteLog.read(path) if r.get("op") == "write"] == [2, 4]
    assert not log.holds_forgettable
    log.close()
    reopened = WriteLog(path)
    assert reopened.last_seq == 5 and reopened.tenant_last == {"acme": 4, "globex": 1}
    assert await reopened.append_numbered(
        {"op": "write", "tenant": "acme", "upserts": [_doc("d", "delta")], "deletes": []}
    ) == (6, 5)
    assert [r["id"] for r in reopened.replay() for r in r.get("upserts", ())] == ["a", "c", "d"]
    reopened.close()


async def test_a_reembed_reads_the_stale_documents_in_batches_of_one_tenant(tmp_path):
    """Which documents a re-embed rewrites (their last write; caller vectors and the
    target's own left alone), streamed in batches of one tenant of at most `size`."""
    from ragline_services.retrieval.reembed import CALLER_VECTOR, stale_batches, stale_keys

    log = WriteLog(tmp_path / "write.log")

    def item(tenant: str, doc_id: str, model: str, text: str = "x") -> dict:
        return {"tenant": tenant, "id": doc_id, "title": "", "text": text, "model": model}

    for tenant, upserts, deletes in (
        ("acme", [item("acme", f"a{i}", "old") for i in range(5)], []),
        ("globex", [item("globex", "g0", "old"), item("globex", "g1", CALLER_VECTOR)], []),
        ("acme", [item("acme", "a0", "new"), item("acme", "a1", "old", "a1 again")], []),
        ("acme", [], ["acme\x1fa2"]),
    ):
        await log.append_numbered(
            {"op": "write", "tenant": tenant, "upserts": upserts, "deletes": deletes}
        )
    stale = stale_keys(log.path, "new")
    assert sorted(stale) == ["acme\x1fa1", "acme\x1fa3", "acme\x1fa4", "globex\x1fg0"]
    batches = list(stale_batches(log.path, stale, 2))
    assert all(len(batch) <= 2 and {s.item["tenant"] for s in batch} == {t} for t, batch in batches)
    found = {s.key: s.item["text"] for _, batch in batches for s in batch}
    assert found == {
        "acme\x1fa1": "a1 again",
        "acme\x1fa3": "x",
        "acme\x1fa4": "x",
        "globex\x1fg0": "x",
    }
    log.close()


async def test_an_opened_log_knows_whether_it_holds_text_a_compaction_would_forget(tmp_path):
    def write(*docs: dict) -> dict:
        return {"op": "write", "tenant": "acme", "upserts": list(docs), "deletes": []}

    path = tmp_path / "write.log"
    log = WriteLog(path)
    await log.append_numbered(write(_doc("a", "alpha"), _doc("b", "bravo")))
    await log.append_numbered(write(_doc("c", "charlie")))
    log.close()
    assert not WriteLog(path).holds_forgettable  # every text is a live document's
    log = WriteLog(path)
    await log.append_numbered(write(_doc("a", "alpha again")))  # the first alpha is replaced
    log.close()
    assert WriteLog(path).holds_forgettable
