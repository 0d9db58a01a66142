"""The retrieval write log: append-only, checksummed, fsynced before a write is acknowledged.

Every upsert and delete is a record here first; the BM25 and vector indexes are derived
from the log and can always be rebuilt from it. Concurrent appends share one fsync (group
commit). A torn or corrupt tail (a crash mid-append) is cut off on open: it was never
acknowledged.

Record framing: 4-byte little-endian payload length, 4-byte CRC32 of the payload, payload
(compact JSON with "seq").
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

_HEADER = struct.Struct("<II")


class WriteLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.last_seq, valid_bytes = self._scan()
        with path.open("ab") as handle:
            if handle.tell() != valid_bytes:
                handle.truncate(valid_bytes)  # drop the unacknowledged torn tail
                os.fsync(handle.fileno())
        self._file = path.open("ab", buffering=0)
        self._lock = threading.Lock()
        self._pending: list[tuple[dict, asyncio.Future]] = []
        self._flusher: asyncio.Future | None = None

    def _scan(self) -> tuple[int, int]:
        last, valid = 0, 0
        for seq, _, end in self._records():
            last, valid = seq, end
        return last, valid

    def _records(self) -> Iterator[tuple[int, dict, int]]:
        if not self.path.exists():
            return
        with self.path.open("rb") as handle:
            offset = 0
            while True:
                header = handle.read(_HEADER.size)
                if len(header) < _HEADER.size:
                    return
                length, crc = _HEADER.unpack(header)
                payload = handle.read(length)
                if len(payload) < length or zlib.crc32(payload) != crc:
                    return
                offset += _HEADER.size + length
                record = json.loads(payload)
                yield record["seq"], record, offset

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

    def _append_sync(self, records: list[dict]) -> list[int]:
        with self._lock:
            frames, seqs = [], []
            for offset, record in enumerate(records, start=1):
                seq = self.last_seq + offset
                payload = json.dumps({**record, "seq": seq}, separators=(",", ":")).encode()
                frames.append(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
                seqs.append(seq)
            size = self._file.tell()
            try:
                self._file.write(b"".join(frames))
                os.fsync(self._file.fileno())
            except OSError:
                # Leave no half-written frame for later records to be appended after.
                self._file.truncate(size)
                raise
            self.last_seq = seqs[-1]
            return seqs

    async def append(self, record: dict) -> int:
        """Appends one record durably; returns its sequence number once it is fsynced.

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
        self._file.close()
