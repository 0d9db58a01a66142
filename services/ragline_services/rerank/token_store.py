"""Candidate token vectors on disk, under the in-memory TokenCache, so that a restarted
rerank service does not encode again what `Prepare` (or earlier queries) encoded.

One SQLite file per token model, projection and width (its name is a digest of them:
vectors of another model are never read back; files of other models are removed at
open). Rows are keyed by (tenant, document id, text digest) like the memory cache, so a
read is only ever of the tenant's own entries. Bounded in bytes: past the bound the
entries used least recently go first. A cache, not a record: SQLite's WAL with normal
sync (a power cut may lose the last writes, never corrupt the file); a file that cannot
be opened or read is set aside and the service goes on without it.

All SQLite work runs on one thread of its own (a connection belongs to its thread), so
the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import sqlite3
import time
from pathlib import Path

import numpy as np
import structlog

log = structlog.get_logger("ragline.rerank.store")

Key = tuple[str, str, str]  # tenant, document id, text digest
Entry = tuple[np.ndarray, np.ndarray]  # int8 rows [tokens, dim], float32 scales [tokens]

# A hit refreshes an entry's last use at most this often (a write per hit would double
# the disk work of a warm query).
_TOUCH_AFTER_S = 60.0


def store_name(model_version: str, dim: int, projection_seed: int) -> str:
    digest = hashlib.sha256(f"{model_version}|{dim}|{projection_seed}".encode()).hexdigest()
    return f"tokens-{digest[:16]}.sqlite"


# Retention is enforced at most this often (on a write, or a read).
_SWEEP_EVERY_S = 60.0


class TokenStore:
    def __init__(self, path: Path, max_bytes: int, retention_s: float = 0.0) -> None:
        """`retention_s`: an entry unused this long is deleted (0: kept until the size
        bound needs its room), so the vectors of a deleted document leave the disk within
        it; deleted rows are overwritten with zeros (SQLite's secure_delete)."""
        self.path = path
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._swept = 0.0
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokens")
        self._db: sqlite3.Connection | None = None
        self.bytes = 0

    async def open(self) -> None:
        await self._run(self._open)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for other in self.path.parent.glob("tokens-*.sqlite*"):
            if not other.name.startswith(self.path.name):
                other.unlink(missing_ok=True)  # another model's vectors: never read again
                log.info("rerank.token_store_removed", file=other.name)
        try:
            self._db = self._connect()
        except sqlite3.DatabaseError as error:
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            self.path.rename(aside)
            log.warning("rerank.token_store_set_aside", file=str(aside), error=str(error))
            self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA secure_delete=ON")
        db.execute(
            "CREATE TABLE IF NOT EXISTS tokens (tenant TEXT, id TEXT, digest TEXT, "
            "rows BLOB, scales BLOB, tokens INTEGER, bytes INTEGER, used REAL, "
            "PRIMARY KEY (tenant, id, digest))"
        )
        db.execute("CREATE INDEX IF NOT EXISTS tokens_used ON tokens (used)")
        (total,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM tokens").fetchone()
        self.bytes = int(total)
        self._sweep(db)
        return db

    def _sweep(self, db: sqlite3.Connection) -> None:
        """Deletes the entries unused for `retention_s`."""
        now = time.time()
        if not self.retention_s or now - self._swept < _SWEEP_EVERY_S:
            return
        self._swept = now
        cutoff = now - self.retention_s
        (gone,) = db.execute(
            "SELECT COALESCE(SUM(bytes), 0) FROM tokens WHERE used < ?", (cutoff,)
        ).fetchone()
        if gone:
            db.execute("DELETE FROM tokens WHERE used < ?", (cutoff,))
            self.bytes -= int(gone)
            log.info("rerank.token_store_expired", bytes=int(gone))

    async def _run(self, function, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, function, *args)

    async def get_many(self, keys: list[Key]) -> dict[Key, Entry]:
        if not keys or self._db is None:
            return {}
        return await self._run(self._get_many, keys)

    def _get_many(self, keys: list[Key]) -> dict[Key, Entry]:
        assert self._db is not None
        found: dict[Key, Entry] = {}
        stale: list[Key] = []
        now = time.time()
        for key in keys:
            row = self._db.execute(
                "SELECT rows, scales, tokens, used FROM tokens "
                "WHERE tenant = ? AND id = ? AND digest = ?",
                key,
            ).fetchone()
            if row is None:
                continue
            rows, scales, tokens, used = row
            vectors = np.frombuffer(rows, dtype=np.int8).reshape(tokens, -1)
            found[key] = (vectors, np.frombuffer(scales, dtype=np.float32))
            if now - used > _TOUCH_AFTER_S:
                stale.append(key)
        if stale:
            self._db.executemany(
                "UPDATE tokens SET used = ? WHERE tenant = ? AND id = ? AND digest = ?",
                [(now, *key) for key in stale],
            )
        self._sweep(self._db)
        return found

    async def put_many(self, entries: dict[Key, Entry]) -> None:
        if entries and self._db is not None:
            await self._run(self._put_many, entries)

    def _put_many(self, entries: dict[Key, Entry]) -> None:
        assert self._db is not None
        now = time.time()
        rows = []
        for (tenant, doc_id, digest), (vectors, scales) in entries.items():
            size = vectors.nbytes + scales.nbytes
            rows.append(
                (
                    tenant,
                    doc_id,
                    digest,
                    vectors.tobytes(),
                    scales.tobytes(),
                    len(vectors),
                    size,
                    now,
                )
            )
        db = self._db
        db.execute("BEGIN")
        try:
            for row in rows:
                (old,) = db.execute(
                    "SELECT COALESCE(SUM(bytes), 0) FROM tokens "
                    "WHERE tenant = ? AND id = ? AND digest = ?",
                    row[:3],
                ).fetchone()
                db.execute("INSERT OR REPLACE INTO tokens VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
                self.bytes += row[6] - int(old)
            self._evict(db)
            self._sweep(db)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            (total,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM tokens").fetchone()
            self.bytes = int(total)
            raise

    async def forget(self, tenant: str, ids: list[str]) -> int:
        """Deletes every entry of `tenant`'s documents `ids`; their bytes are overwritten
        in the file (secure_delete) and the write-ahead file is emptied, so the vectors
        are in neither file afterwards. Returns how many entries went."""
        if not ids or self._db is None:
            return 0
        return await self._run(self._forget, tenant, ids)

    def _forget(self, tenant: str, ids: list[str]) -> int:
        assert self._db is not None
        db = self._db
        gone = 0
        for start in range(0, len(ids), 500):  # SQLite's bound on variables per statement
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            count, size = db.execute(
                f"SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM tokens "
                f"WHERE tenant = ? AND id IN ({marks})",
                (tenant, *chunk),
            ).fetchone()
            if count:
                db.execute(
                    f"DELETE FROM tokens WHERE tenant = ? AND id IN ({marks})", (tenant, *chunk)
                )
                self.bytes -= int(size)
                gone += int(count)
        if gone:
            # Until a checkpoint, the pages as they were stay in the -wal file.
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return gone

    def _evict(self, db: sqlite3.Connection) -> None:
        while self.bytes > self.max_bytes:
            victims = db.execute(
                "SELECT tenant, id, digest, bytes FROM tokens ORDER BY used LIMIT 32"
            ).fetchall()
            if not victims:
                self.bytes = 0
                return
            chosen = []
            for victim in victims:  # only as many as the bound needs
                chosen.append(victim[:3])
                self.bytes -= victim[3]
                if self.bytes <= self.max_bytes:
                    break
            db.executemany("DELETE FROM tokens WHERE tenant = ? AND id = ? AND digest = ?", chosen)

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._executor.submit(shut).result()
        self._executor.shutdown(wait=True)
