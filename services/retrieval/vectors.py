"""Vector search: Qdrant's engine, HNSW built off the query path, writes searchable at once.

Embedded default (`EdgeVectorIndex`): the HNSW index is a `qdrant-edge-py` shard (Qdrant's
own engine) built in a separate process from a snapshot of the write log and swapped in
atomically when it is ready; queries never wait for a build (`optimize()` holds the
shard for its whole run, measured: a query issued during an 8 s build waited 8 s).
Writes since the snapshot live in a small delta that is searched exactly and overrides
the shard (newer versions, deletions). Before any shard exists the whole collection is
the delta; above `exact_limit` points that is too slow to search exactly and the service
answers from BM25 instead, saying so.

`QdrantServerIndex` (qdrant_server.py) is the cluster backend: Qdrant indexes in the
background itself, so it has no delta and no builder.

Both filter by tenant, scopes and attributes inside the engine, never after the fact, with
cosine distance and the same HNSW settings (m=16, ef_construct=200).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ragline_services.retrieval.documents import Candidate, StoredDocument, Visibility

HNSW_M = 16
HNSW_EF_CONSTRUCT = 200


def point_id(key: str) -> int:
    """A stable 63-bit point id for a document key (the key is also kept in the payload)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class VectorIndexStatus:
    points: int
    indexed_points: int  # inside the HNSW shard; the rest (the delta) is searched exactly
    ready: bool  # vector search can answer (else the service falls back to BM25)
    building: bool
    built_seq: int  # write-log sequence the HNSW shard covers


class VectorIndex(Protocol):
    dim: int

    def apply(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None: ...

    def search(
        self,
        vector: np.ndarray,
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_keys: list[str] | None = None,
    ) -> list[Candidate]: ...

    def needs_build(self) -> bool: ...

    def build(self, upto_seq: int) -> None:
        """Builds a new HNSW index covering the log up to `upto_seq`, then swaps it in."""

    def status(self) -> VectorIndexStatus: ...

    def close(self) -> None: ...


@dataclass
class _DeltaEntry:
    seq: int
    vector: np.ndarray | None  # None: deleted
    tenant: str
    scopes: frozenset[str]
    attrs: frozenset[str]


def _visible(entry: _DeltaEntry, visibility: Visibility) -> bool:
    return (
        entry.tenant == visibility.tenant
        and not entry.scopes.isdisjoint(visibility.allowed_scopes)
        and set(visibility.attribute_terms) <= entry.attrs
    )


class EdgeVectorIndex:
    def __init__(
        self,
        directory: Path,
        dim: int,
        wal_path: Path,
        *,
        exact_limit: int = 20_000,
        rebuild_after: int = 2_000,
    ) -> None:
        self.directory = directory
        self.dim = dim
        self.wal_path = wal_path
        self.exact_limit = exact_limit
        self.rebuild_after = rebuild_after
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards shard / delta swaps, never held for I/O
        self._delta: dict[str, _DeltaEntry] = {}
        self._delta_cache: tuple[list[str], np.ndarray] | None = None
        self._shard = None
        self._shard_points = 0
        self.built_seq = 0
        self.building = False
        self._builder: subprocess.Popen | None = None
        self._load_current()

    # -- the built shard ----------------------------------------------------------------

    def _load_current(self) -> None:
        manifest = self.directory / "current.json"
        if not manifest.exists():
            return
        current = json.loads(manifest.read_text())
        import qdrant_edge as qe

        self._shard = qe.EdgeShard.load(str(self.directory / current["dir"]))
        self._shard_points = current["points"]
        self.built_seq = current["seq"]

    def needs_build(self) -> bool:
        return not self.building and len(self._delta) >= (
            1 if self._shard is None else self.rebuild_after
        )

    def build(self, upto_seq: int) -> None:
        """Runs in a worker thread: the build itself is a separate process."""
        self.building = True
        try:
            name = f"hnsw-{upto_seq}"
            target = self.directory / name
            if target.exists():
                shutil.rmtree(target)
            self._builder = subprocess.Popen(
                [sys.executable, "-m", "ragline_services.retrieval.hnsw_builder",
                 str(self.wal_path), str(upto_seq), str(target), str(self.dim)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            out, err = self._builder.communicate()
            if self._builder.returncode != 0:
                raise RuntimeError(f"HNSW build failed ({self._builder.returncode}): {err[-2000:]}")
            points = int(out.strip().splitlines()[-1])
            import qdrant_edge as qe

            shard = qe.EdgeShard.load(str(target))
            with self._lock:
                old, self._shard = self._shard, shard
                self._shard_points = points
                self.built_seq = upto_seq
                self._delta = {k: e for k, e in self._delta.items() if e.seq > upto_seq}
                self._delta_cache = None
            (self.directory / "current.json.tmp").write_text(
                json.dumps({"dir": name, "seq": upto_seq, "points": points})
            )
            (self.directory / "current.json.tmp").replace(self.directory / "current.json")
            if old is not None:
                old.close()
            for stale in self.directory.glob("hnsw-*"):
                if stale.name != name:
                    shutil.rmtree(stale, ignore_errors=True)
        finally:
            self.building = False

    # -- writes ---------------------------------------------------------------------------

    def apply(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None:
        if seq <= self.built_seq:
            return  # already inside the shard (a replay after restart)
        with self._lock:
            for key in deletes:
                tenant = key.split("\x1f", 1)[0]
                self._delta[key] = _DeltaEntry(seq, None, tenant, frozenset(), frozenset())
            for doc in upserts:
                vector = np.asarray(doc.vector, dtype=np.float32)
                vector /= max(float(np.linalg.norm(vector)), 1e-12)
                self._delta[doc.key] = _DeltaEntry(
                    seq, vector, doc.tenant, frozenset(doc.scopes), frozenset(doc.attribute_terms)
                )
            self._delta_cache = None

    # -- reads ----------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._shard is not None or len(self._delta) <= self.exact_limit

    def _delta_search(
        self, vector: np.ndarray, visibility: Visibility, k: int, only: set[str] | None
    ) -> list[Candidate]:
        keys = [
            key
            for key, entry in self._delta.items()
            if entry.vector is not None
            and _visible(entry, visibility)
            and (only is None or key in only)
        ]
        if not keys:
            return []
        matrix = np.stack([self._delta[key].vector for key in keys])
        scores = matrix @ vector
        top = np.argsort(-scores)[:k]
        return [Candidate(keys[i], float(scores[i])) for i in top]

    def search(
        self,
        vector: np.ndarray,
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_keys: list[str] | None = None,
    ) -> list[Candidate]:
        vector = np.asarray(vector, dtype=np.float32)
        vector /= max(float(np.linalg.norm(vector)), 1e-12)
        with self._lock:
            shard, delta = self._shard, self._delta
            only = set(only_keys) if only_keys is not None else None
            found = self._delta_search(vector, visibility, k, only)
            shadowed = len(delta)
        if shard is not None:
            # Over-fetch by what the delta may shadow (newer versions, deletions).
            extra = min(shadowed, 1000)
            for candidate in self._shard_search(
                shard, vector, visibility, k + extra, hnsw_ef, only_keys
            ):
                if candidate.key not in delta:
                    found.append(candidate)
        found.sort(key=lambda c: -c.score)
        return found[:k]

    @staticmethod
    def _shard_search(shard, vector, visibility, limit, hnsw_ef, only_keys):
        import qdrant_edge as qe

        must = [
            qe.FieldCondition(key="tenant", match=qe.MatchValue(visibility.tenant)),
            qe.FieldCondition(key="scope", match=qe.MatchAny(visibility.allowed_scopes)),
        ]
        for term in visibility.attribute_terms:
            must.append(qe.FieldCondition(key="attr", match=qe.MatchValue(term)))
        if only_keys is not None:
            must.append(qe.FieldCondition(key="key", match=qe.MatchAny(list(only_keys))))
        request = qe.QueryRequest(
            limit=limit,
            query=qe.Query.Nearest(vector.tolist()),
            filter=qe.Filter(must=must),
            with_payload=True,
            params=qe.SearchParams(hnsw_ef=hnsw_ef, exact=only_keys is not None),
        )
        return [Candidate(p.payload["key"], float(p.score)) for p in shard.query(request)]

    def status(self) -> VectorIndexStatus:
        with self._lock:
            live_delta = sum(1 for e in self._delta.values() if e.vector is not None)
            return VectorIndexStatus(
                points=self._shard_points + live_delta,
                indexed_points=self._shard_points,
                ready=self.ready(),
                building=self.building,
                built_seq=self.built_seq,
            )

    def delta_size(self) -> int:
        return len(self._delta)

    def close(self) -> None:
        if self._builder is not None and self._builder.poll() is None:
            self._builder.kill()  # a build in flight is simply redone after restart
        if self._shard is not None:
            self._shard.close()
