from __future__ import annotations

import asyncio

from ragline_services.retrieval.wal import WriteLog


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
