"""Point id -> (key, version, visibility) of every document: what a search resolves its hits
with, without loading a stored document.

The engines return point ids (`point_id(key)`, a hash: not reversible). Tantivy's Python
bindings read only numeric fast fields, so a hit's key could only come from its stored
document, which holds the title and text too: loading ten of them was a fifth of a search's
time at 254k documents. This map answers the same question from one indexed SQLite read.

It is also the last word on visibility: a search's hits pass through `Entry.visible_to`
here, so a document whose acl was narrowed is hidden even from an engine that has not
applied the change yet. Hence the order of an apply: the map first, then the engines.

The file sits inside the BM25 index's folder and moves with it (a layout change sets both
aside and the write log rebuilds both). Commits are synchronous (fsync): the index's
`bm25_seq` says what was applied, and replay starts after it, so an apply the map lost to a
power cut would never come back.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from ragline_services.retrieval.documents import StoredDocument, Visibility, point_id

FILE = "keys.sqlite"
_SEPARATOR = "\x1f"
# SQLite's default limit of host parameters is 32,766; stay far below it per statement.
_CHUNK = 900


@dataclass(frozen=True)
class Entry:
    key: str
    version: int
    scopes: frozenset[str]
    attribute_terms: frozenset[str]

    def visible_to(self, visibility: Visibility) -> bool:
        """The engines' filter: any allowed scope, and every asked attribute."""
        return not self.scopes.isdisjoint(
            visibility.allowed_scopes
        ) and self.attribute_terms.issuperset(visibility.attribute_terms)


def _split(joined: str) -> frozenset[str]:
    return frozenset(joined.split(_SEPARATOR)) if joined else frozenset()


class KeyMap:
    """One SQLite file for every tenant; rows keyed by (tenant, point id)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        db = self._db()
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE IF NOT EXISTS documents (tenant TEXT NOT NULL, pid INTEGER NOT NULL,"
            " key TEXT NOT NULL, version INTEGER NOT NULL, scopes TEXT NOT NULL,"
            " attributes TEXT NOT NULL, PRIMARY KEY (tenant, pid)) WITHOUT ROWID"
        )
        db.commit()

    def _db(self) -> sqlite3.Connection:
        """One connection per thread (searches read from several threads at once)."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, isolation_level="DEFERRED", check_same_thread=False)
            db.execute("PRAGMA synchronous=FULL")
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    def apply(self, tenant: str, upserts: list[StoredDocument], deletes: list[str]) -> None:
        """Deletes then upserts of one tenant, in one transaction (as the BM25 apply)."""
        rows = [
            (
                tenant,
                point_id(d.key),
                d.key,
                d.version,
                _SEPARATOR.join(d.scopes),
                _SEPARATOR.join(d.attribute_terms),
            )
            for d in upserts
        ]
        with self._write_lock:
            db = self._db()
            with db:
                db.executemany(
                    "DELETE FROM documents WHERE tenant = ? AND pid = ?",
                    [(tenant, point_id(key)) for key in deletes],
                )
                db.executemany("INSERT OR REPLACE INTO documents VALUES (?, ?, ?, ?, ?, ?)", rows)

    def lookup(self, tenant: str, pids: list[int]) -> dict[int, Entry]:
        """The entries of `pids` that are documents of `tenant` (visibility not checked)."""
        out: dict[int, Entry] = {}
        db = self._db()
        unique = list(dict.fromkeys(pids))
        for start in range(0, len(unique), _CHUNK):
            chunk = unique[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            for pid, key, version, scopes, attributes in db.execute(
                "SELECT pid, key, version, scopes, attributes FROM documents"
                f" WHERE tenant = ? AND pid IN ({marks})",
                [tenant, *chunk],
            ):
                out[pid] = Entry(key, version, _split(scopes), _split(attributes))
        return out

    def count(self, tenant: str) -> int:
        (found,) = (
            self._db()
            .execute("SELECT COUNT(*) FROM documents WHERE tenant = ?", (tenant,))
            .fetchone()
        )
        return int(found)

    def close(self) -> None:
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()
