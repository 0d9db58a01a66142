"""The retrieval write log: append-only, checksummed, fsynced before a write is acknowledged.

Every upsert and delete is a record here first; the BM25 and vector indexes are derived
from the log and can always be rebuilt from it. Concurrent appends share one fsync (group
commit), and no append is acknowledged before its fsync returns.

On open, a torn tail (a crash mid-append: a bad frame with no good frame after it) is cut
off: it was never acknowledged. A bad frame with good frames after it is corruption, not a
crash, and acknowledged writes lie behind it: the log refuses to open (CorruptLog) and says
how to repair it (`python -m ragline_services.retrieval.wal repair PATH` keeps every good
frame and moves the damaged file aside).

Every record gets "seq", its position in the log, and, when it names its "tenant", "tseq":
its position among that tenant's records. Tenants see only their own numbering (a global
sequence would show them how much everyone else writes); operators see both.

Record framing: 4-byte little-endian payload length, 4-byte CRC32 of the payload, payload
(compact JSON with "seq").

Compaction (`compact`) rewrites the log with only what a replay still needs: the latest
write of each live document (at its own seq and tseq, so versions do not change) and the
deletes the indexes may not have applied yet (newer than what both persisted). A
superseded version and a delete both indexes hold are dropped, and with them the text of
deleted and overwritten documents. A "marks" record heads the rewritten log with the last
seq and each tenant's last tseq, so numbering goes on from where it was. The new log is
written beside the old, fsynced and renamed over it: a crash leaves one or the other.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from ragline.errors import StartRefused
from ragline.files import fsync_directory, write_all
from ragline_services.retrieval.documents import StoredDocument, doc_key, split_key

_HEADER = struct.Struct("<II")
MARKS = "marks"  # the op of the record heading a compacted log


def _frame(record: dict) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


class CorruptLog(StartRefused):
    """A bad frame in the middle of the log (good frames follow it)."""

    def __init__(self, path: Path, offset: int, last_seq: int, next_good: int) -> None:
        self.path, self.offset, self.last_seq, self.next_good = path, offset, last_seq, next_good
        super().__init__(
            f"write log {path} is corrupt at byte {offset} (after record {last_seq}), and good "
            f"records follow at byte {next_good}: this is not a crash mid-append, and "
            "acknowledged writes lie behind the damage, so the service will not cut them off. "
            f"Repair: python -m ragline_services.retrieval.wal repair {path} (keeps every good "
            "record, moves the damaged file aside), or restore the index directory from a copy."
        )


def tenant_of(record: dict) -> str | None:
    """The tenant a record writes for (records before "tenant" was logged: from its keys)."""
    if "tenant" in record:
        return record["tenant"]
    if record.get("upserts"):
        return record["upserts"][0].get("tenant")
    if record.get("deletes"):
        return split_key(record["deletes"][0])[0]
    return None


def tenant_seq(record: dict) -> int:
    """The record's number among its tenant's records; records logged before tenants were
    numbered count with their global sequence, so a tenant's numbers only ever grow."""
    return record.get("tseq", record["seq"])


def _frame_at(data: bytes, offset: int) -> tuple[dict, int] | None:
    """The record framed at `offset` of `data` and the offset after it, if the frame is good."""
    if offset + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, offset)
    end = offset + _HEADER.size + length
    if end > len(data):
        return None
    payload = data[offset + _HEADER.size : end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("seq"), int):
        return None
    return record, end


def _next_good_frame(data: bytes, start: int) -> int | None:
    """The first good frame at or after `start`. A frame's payload is a JSON object, so only
    offsets 8 bytes before a `{` can start one: `find` jumps between them in C (a torn tail
    of zeros, or megabytes of garbage, is crossed in linear time, not tried byte by byte)."""
    brace = data.find(b"{", start + _HEADER.size)
    while brace != -1:
        if _frame_at(data, brace - _HEADER.size) is not None:
            return brace - _HEADER.size
        brace = data.find(b"{", brace + 1)
    return None


class WriteLog:
    def __init__(self, path: Path, *, fsync: Callable[[int], None] = os.fsync) -> None:
        self.path = path
        self._fsync = fsync
        path.parent.mkdir(parents=True, exist_ok=True)
        created = not path.exists()
        self.tenant_last: dict[str, int] = {}  # the last "tseq" of each tenant
        # Text a compaction would forget is logged: a delete's, or a document's written
        # again (found when the log is opened; a delete appended later sets it too, and
        # the index notes its own overwrites).
        self.holds_forgettable = False
        self.last_seq, valid_bytes = self._scan()
        with path.open("ab") as handle:
            if handle.tell() != valid_bytes:
                handle.truncate(valid_bytes)  # drop the unacknowledged torn tail
                self._fsync(handle.fileno())
        if created:
            fsync_directory(path.parent)  # the file's directory entry is durable too
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._lock = threading.Lock()
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._flusher: asyncio.Future | None = None

    def _scan(self) -> tuple[int, int]:
        last, valid = 0, 0
        written: set[str] = set()
        for seq, record, end in self._records(check_tail=True):
            last, valid = max(last, seq, record.get("last_seq", 0)), end
            for tenant, tseq in record.get("tenant_last", {}).items():  # a compacted log's
                self.tenant_last[tenant] = max(self.tenant_last.get(tenant, 0), tseq)
            tenant = tenant_of(record)
            if tenant is not None:
                self.tenant_last[tenant] = max(self.tenant_last.get(tenant, 0), tenant_seq(record))
            keys = [doc_key(item["tenant"], item["id"]) for item in record.get("upserts", ())]
            again = not written.isdisjoint(keys)
            written.update(keys)
            self.holds_forgettable = self.holds_forgettable or again or bool(record.get("deletes"))
        return last, valid

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def compact(self, applied_by_all: int) -> tuple[int, int, int, set[str]]:
        """Rewrites the log keeping only what a replay after `applied_by_all` (the seq
        every index has persisted) can need; returns (bytes before, bytes after, records
        dropped, tenants whose deleted or overwritten text was dropped). Appends wait
        meanwhile. Runs in a thread: it reads the whole log twice."""
        with self._lock:
            before = self.size
            latest: dict[str, int] = {}  # the seq of each key's last write or delete
            for seq, record, _ in self._records():
                for item in record.get("upserts", ()):
                    latest[doc_key(item["tenant"], item["id"])] = seq
                for key in record.get("deletes", ()):
                    latest[key] = seq
            target = self.path.with_name(self.path.name + ".compact")
            dropped, kept_deletes = 0, False
            forgotten: set[str] = set()
            with target.open("wb") as out:
                marks = {
                    "op": MARKS,
                    "seq": 0,
                    "last_seq": self.last_seq,
                    "tenant_last": self.tenant_last,
                }
                out.write(_frame(marks))
                for seq, record, _ in self._records():
                    if record.get("op") == MARKS:
                        continue
                    upserts = [
                        item
                        for item in record.get("upserts", ())
                        if latest.get(doc_key(item["tenant"], item["id"])) == seq
                    ]
                    if len(upserts) < len(record.get("upserts", ())):
                        forgotten.update(item["tenant"] for item in record["upserts"])
                    deletes = [
                        key
                        for key in record.get("deletes", ())
                        if latest.get(key) == seq and seq > applied_by_all
                    ]
                    if not upserts and not deletes:
                        dropped += 1
                        continue
                    kept_deletes = kept_deletes or bool(deletes)
                    out.write(_frame({**record, "upserts": upserts, "deletes": deletes}))
                out.flush()
                self._fsync(out.fileno())
            os.replace(target, self.path)
            fsync_directory(self.path.parent)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self.holds_forgettable = kept_deletes  # tombstones; one version of each text
            return before, self.size, dropped, forgotten

    def _records(self, check_tail: bool = False) -> Iterator[tuple[int, dict, int]]:
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            offset, last_seq = 0, 0
            while True:
                header = handle.read(_HEADER.size)
                if not header:
                    return
                good = None
                if len(header) == _HEADER.size:
                    length, _ = _HEADER.unpack(header)
                    payload = handle.read(length)
                    good = _frame_at(header + payload, 0)
                if good is None:
                    if check_tail:
                        self._check_torn_tail(handle, offset, last_seq)
                    return
                record, size = good
                offset += size
                last_seq = record["seq"]
                yield last_seq, record, offset

    def _check_torn_tail(self, handle, offset: int, last_seq: int) -> None:
        """Raises CorruptLog unless the bad frame at `offset` is a torn tail."""
        handle.seek(offset)
        rest = handle.read()
        found = _next_good_frame(rest, 1)
        if found is not None:
            raise CorruptLog(self.path, offset, last_seq, offset + found)

    @classmethod
    def read(cls, path: Path) -> Iterator[dict]:
        """Reads a log without opening it for writing (another process may own it)."""
        reader = cls.__new__(cls)
        reader.path = path
        for _, record, _ in reader._records():
            yield record

    def replay(self, after_seq: int = 0) -> Iterator[dict]:
        """Every acknowledged record with seq > after_seq, in order."""
        for seq, record, _ in self._records():
            if seq > after_seq:
                yield record

    def _append_sync(self, records: list[dict]) -> list[tuple[int, int | None]]:
        with self._lock:
            frames, seqs = [], []
            tenant_last = dict(self.tenant_last)
            for offset, record in enumerate(records, start=1):
                seq = self.last_seq + offset
                numbered = {**record, "seq": seq}
                tseq = None
                if "tenant" in record:
                    tseq = tenant_last.get(record["tenant"], 0) + 1
                    tenant_last[record["tenant"]] = numbered["tseq"] = tseq
                frames.append(_frame(numbered))
                seqs.append((seq, tseq))
            size = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                write_all(self._fd, b"".join(frames))
                self._fsync(self._fd)
            except OSError:
                # Leave no half-written frame for later records to be appended after.
                os.truncate(self._fd, size)
                raise
            self.last_seq = seqs[-1][0]
            self.tenant_last = tenant_last
            self.holds_forgettable = self.holds_forgettable or any(
                r.get("deletes") for r in records
            )
            return seqs

    async def append(self, record: dict) -> int:
        """Appends one record durably; returns its sequence number once it is fsynced."""
        seq, _ = await self.append_numbered(record)
        return seq

    async def append_numbered(self, record: dict) -> tuple[int, int | None]:
        """Appends one record durably; returns (seq, tseq) once it is fsynced (tseq: its
        number among its tenant's records, None when the record names no tenant).

        Records that arrive while a flush is running are written together by the next
        flush, so concurrent writers share one fsync (group commit). The flush runs in its
        own task: a caller that gives up does not stop a write that is already under way
        (its record may still become durable, like any write whose answer was lost).
        """
        future = asyncio.get_running_loop().create_future()
        self._pending.append((record, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                seqs = await asyncio.to_thread(self._append_sync, [r for r, _ in batch])
            except Exception as error:  # disk full, I/O error: nothing was acknowledged
                for _, waiter in batch:
                    if not waiter.done():
                        waiter.set_exception(error)
                continue
            for (_, waiter), seq in zip(batch, seqs, strict=True):
                if not waiter.done():
                    waiter.set_result(seq)

    def close(self) -> None:
        os.close(self._fd)


def live_documents(path: Path, upto_seq: int | None = None) -> Iterator[StoredDocument]:
    """Each live document of the log as of `upto_seq` (None: its end), at its version,
    read twice so that only keys are held in memory, never the corpus: first which write
    of each key is its last (a delete drops it), then those writes, one at a time."""

    def records() -> Iterator[dict]:
        for record in WriteLog.read(path):
            if upto_seq is not None and record["seq"] > upto_seq:
                return
            yield record

    last: dict[str, int] = {}
    for record in records():
        for key in record.get("deletes", ()):
            last.pop(key, None)
        for item in record.get("upserts", ()):
            last[doc_key(item["tenant"], item["id"])] = record["seq"]
    for record in records():
        for item in record.get("upserts", ()):
            if last.get(doc_key(item["tenant"], item["id"])) == record["seq"]:
                yield StoredDocument.from_record({**item, "version": tenant_seq(record)})


def repair(path: Path) -> str:
    """Rewrites the log with every good frame (in order, gaps left as they are) and moves
    the damaged file aside. Returns what it did."""
    data = path.read_bytes()
    kept: list[bytes] = []
    offset, skipped, seqs = 0, 0, []
    while offset < len(data):
        good = _frame_at(data, offset)
        if good is None:
            following = _next_good_frame(data, offset + 1)
            if following is None:
                skipped += len(data) - offset
                break
            skipped += following - offset
            offset = following
            continue
        record, end = good
        kept.append(data[offset:end])
        seqs.append(record["seq"])
        offset = end
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, b"".join(kept))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_directory(path.parent)
    missing = sorted(set(range(1, (max(seqs) if seqs else 0) + 1)) - set(seqs))
    return (
        f"kept {len(kept)} records, skipped {skipped} damaged bytes; records lost to the "
        f"damage: {missing or 'none'}; the damaged file is {aside}"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "repair":
        print("usage: python -m ragline_services.retrieval.wal repair PATH", file=sys.stderr)
        return 2
    print(repair(Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
