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

import json
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ragline.files import atomic_write_text
from ragline.processes import dying_with_this_process
from ragline_services.retrieval.documents import (
    Candidate,
    StoredDocument,
    Visibility,
    point_id,
    split_key,
)
from ragline_services.retrieval.shard_process import LocalShard, ShardProcess, ShardQuery

HNSW_M = 16
HNSW_EF_CONSTRUCT = 200
POINT_IDS_FILE = "point_ids.npy"  # in a built shard's directory: its point ids, sorted


def load_point_ids(shard_dir: Path) -> np.ndarray | None:
    """The point ids a built shard holds; None for one built before they were recorded
    (then every delta key is excluded from its queries, as before)."""
    path = shard_dir / POINT_IDS_FILE
    return np.load(path) if path.exists() else None


def _unit(vector) -> np.ndarray:
    """A float32 copy scaled to length 1 (cosine = dot product); the input is not changed."""
    vector = np.asarray(vector, dtype=np.float32)
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


@dataclass(frozen=True)
class VectorIndexStatus:
    points: int
    indexed_points: int  # inside the HNSW shard; the rest (the delta) is searched exactly
    ready: bool  # vector search can answer (else the service falls back to BM25)
    building: bool
    built_seq: int  # write-log sequence the HNSW shard covers


class VectorIndex(Protocol):
    dim: int
    # Write-log sequence the built index covers (replay re-applies what came after).
    built_seq: int

    def apply(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None: ...

    def search(
        self,
        vector: np.ndarray,
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_pids: list[int] | None = None,
    ) -> list[Candidate]:
        """Nearest documents by point id (no payload read); `only_pids` restricts the
        search to those documents, exactly."""

    def ready(self) -> bool:
        """Whether vector search can answer now (a flag: no I/O, called on every search)."""

    def needs_build(self) -> bool: ...

    def request_build(self) -> None:
        """A build from the (compacted) log soon, whatever the delta: the files of the
        current one hold documents since deleted."""

    def build(self, upto_seq: int) -> None:
        """Builds a new HNSW index covering the log up to `upto_seq`, then swaps it in."""

    def status(self) -> VectorIndexStatus:
        """Sizes and build state for IndexStatus (may do I/O: call it from a thread)."""

    def close(self) -> None: ...


@dataclass
class _DeltaEntry:
    seq: int
    vector: np.ndarray | None  # None: deleted
    tenant: str
    scopes: frozenset[str]
    attrs: frozenset[str]
    point_id: int


@dataclass(frozen=True)
class _TenantDelta:
    """One tenant's delta as arrays: built once after a write, not on every query (the
    per-query scan of the whole delta was the query path's cost while writes streamed in)."""

    pids: list[int]  # point ids of the entries with a vector
    rows: dict[int, int]
    matrix: np.ndarray  # their normalised vectors, one row per entry
    scopes: list[frozenset[str]]
    attrs: list[frozenset[str]]
    # Point ids of the tenant's delta keys (deletions included) that the shard holds too:
    # its copy is stale, so the shard query excludes them inside the engine (no over-fetch).
    # A key new since the build is not in the shard and costs the query nothing.
    shadow_ids: set[int]

    def search(
        self, vector: np.ndarray, visibility: Visibility, k: int, only: list[int] | None
    ) -> list[Candidate]:
        if not self.pids:
            return []
        if only is None:
            rows = np.arange(len(self.pids))
            scores = self.matrix @ vector
        else:
            rows = np.asarray([self.rows[pid] for pid in only if pid in self.rows], dtype=int)
            if not rows.size:
                return []
            scores = self.matrix[rows] @ vector
        allowed = set(visibility.allowed_scopes)
        wanted = set(visibility.attribute_terms)
        found = []
        for i in np.argsort(-scores):
            row = rows[i]
            if self.scopes[row].isdisjoint(allowed) or not wanted <= self.attrs[row]:
                continue
            found.append(Candidate(self.pids[row], float(scores[i])))
            if len(found) == k:
                break
        return found


def _in_shard(pids: list[int], shard_pids: np.ndarray | None) -> set[int]:
    """Those of `pids` the shard holds (`shard_pids` sorted; None: unknown, so all)."""
    if shard_pids is None:
        return set(pids)
    if not pids or not len(shard_pids):
        return set()
    wanted = np.asarray(pids, dtype=np.int64)
    at = np.searchsorted(shard_pids, wanted)  # past the end: clipped, then unequal
    held = np.take(shard_pids, at, mode="clip") == wanted
    return set(wanted[held].tolist())


def _tenant_deltas(
    delta: dict[str, _DeltaEntry], dim: int, shard_pids: np.ndarray | None
) -> dict[str, _TenantDelta]:
    grouped: dict[str, list[tuple[str, _DeltaEntry]]] = {}
    for key, entry in delta.items():
        grouped.setdefault(entry.tenant, []).append((key, entry))
    out = {}
    for tenant, items in grouped.items():
        live = [(entry, entry.vector) for _, entry in items if entry.vector is not None]
        out[tenant] = _TenantDelta(
            pids=[entry.point_id for entry, _ in live],
            rows={entry.point_id: row for row, (entry, _) in enumerate(live)},
            matrix=(
                np.stack([vector for _, vector in live])
                if live
                else np.zeros((0, dim), dtype=np.float32)
            ),
            scopes=[entry.scopes for entry, _ in live],
            attrs=[entry.attrs for entry, _ in live],
            shadow_ids=_in_shard([entry.point_id for _, entry in items], shard_pids),
        )
    return out


class EdgeVectorIndex:
    def __init__(
        self,
        directory: Path,
        dim: int,
        wal_path: Path,
        *,
        exact_limit: int = 20_000,
        rebuild_after: int = 2_000,
        build_threads: int = 1,
        build_niceness: int = 19,
        build_idle: bool = True,
        search_process: bool = False,
    ) -> None:
        self.directory = directory
        # Each shard searched in a child process of its own (shard_process.py: qdrant-edge
        # holds the GIL while it searches), or in this one.
        self.search_process = search_process
        self.build_threads = build_threads
        self.build_niceness = build_niceness
        self.build_idle = build_idle
        self.dim = dim
        self.wal_path = wal_path
        self.exact_limit = exact_limit
        self.rebuild_after = rebuild_after
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards shard / delta swaps, never held for I/O
        self._delta: dict[str, _DeltaEntry] = {}
        self._by_tenant: dict[str, _TenantDelta] | None = None  # derived from _delta
        self._shard = None
        self._shard_dir: Path | None = None
        self._shard_pids: np.ndarray | None = None  # sorted; None: not recorded (old build)
        # Searches in flight per shard (by id): a swapped-out shard is closed and its files
        # removed only once the last search that took it has finished.
        self._readers: dict[int, int] = {}
        # (a qdrant_edge shard, its folder); the package has no type stubs.
        self._retired: list[tuple[Any, Path]] = []
        self._shard_points = 0
        self.built_seq = 0
        self.building = False
        self._build_requested = False
        self._builder: subprocess.Popen | None = None
        self._load_current()

    # -- the built shard ----------------------------------------------------------------

    def _load_current(self) -> None:
        manifest = self.directory / "current.json"
        if not manifest.exists():
            return
        current = json.loads(manifest.read_text())
        self._shard_dir = self.directory / current["dir"]
        self._shard = self._open(self._shard_dir)
        self._shard_pids = load_point_ids(self._shard_dir)
        self._shard_points = current["points"]
        self.built_seq = current["seq"]

    def _open(self, path: Path):
        return ShardProcess(str(path)) if self.search_process else LocalShard(str(path))

    def needs_build(self) -> bool:
        return not self.building and (
            (self._build_requested and self._shard is not None)
            or len(self._delta) >= (1 if self._shard is None else self.rebuild_after)
        )

    def request_build(self) -> None:
        self._build_requested = True

    def build(self, upto_seq: int) -> None:
        """Runs in a worker thread: the build itself is a separate process."""
        self.building = True
        self._build_requested = False
        try:
            # Unique: a build asked for after a compaction may cover the same seq as the
            # shard being searched, whose directory must stay until it is swapped out.
            name = f"hnsw-{upto_seq}-{time.time_ns()}"
            target = self.directory / name
            if target.exists():
                shutil.rmtree(target)
            # From a worker thread of the loop's executor (it lives as long as the process).
            self._builder = subprocess.Popen(
                dying_with_this_process(
                    [
                        sys.executable,
                        "-m",
                        "ragline_services.retrieval.hnsw_builder",
                        str(self.wal_path),
                        str(upto_seq),
                        str(target),
                        str(self.dim),
                        "--threads",
                        str(self.build_threads),
                        "--niceness",
                        str(self.build_niceness),
                        *(["--idle"] if self.build_idle else []),
                    ]
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            out, err = self._builder.communicate()
            if self._builder.returncode != 0:
                raise RuntimeError(f"HNSW build failed ({self._builder.returncode}): {err[-2000:]}")
            points = int(out.strip().splitlines()[-1])
            shard = self._open(target)
            shard_pids = load_point_ids(target)
            with self._lock:
                if self._shard is not None:
                    self._retired.append((self._shard, self._shard_dir))
                self._shard, self._shard_dir = shard, target
                self._shard_pids = shard_pids
                self._shard_points = points
                self.built_seq = upto_seq
                self._delta = {k: e for k, e in self._delta.items() if e.seq > upto_seq}
                self._by_tenant = None
            atomic_write_text(
                self.directory / "current.json",
                json.dumps({"dir": name, "seq": upto_seq, "points": points}),
            )
            self._release_retired()
            busy = {path for _, path in self._retired} | {target}
            for stale in self.directory.glob("hnsw-*"):
                if stale not in busy:  # left by a crash or a failed build
                    shutil.rmtree(stale, ignore_errors=True)
        finally:
            self.building = False

    def _release_retired(self) -> None:
        with self._lock:
            idle = [(s, p) for s, p in self._retired if not self._readers.get(id(s))]
            self._retired = [(s, p) for s, p in self._retired if self._readers.get(id(s))]
        for shard, path in idle:
            shard.close()
            shutil.rmtree(path, ignore_errors=True)

    # -- writes ---------------------------------------------------------------------------

    def apply(self, seq: int, upserts: list[StoredDocument], deletes: list[str]) -> None:
        if seq <= self.built_seq:
            return  # already inside the shard (a replay after restart)
        with self._lock:
            for key in deletes:
                tenant, _ = split_key(key)
                self._delta[key] = _DeltaEntry(
                    seq, None, tenant, frozenset(), frozenset(), point_id(key)
                )
            for doc in upserts:
                self._delta[doc.key] = _DeltaEntry(
                    seq,
                    _unit(doc.vector),
                    doc.tenant,
                    frozenset(doc.scopes),
                    frozenset(doc.attribute_terms),
                    point_id(doc.key),
                )
            self._by_tenant = None

    # -- reads ----------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._shard is not None or len(self._delta) <= self.exact_limit

    def search(
        self,
        vector: np.ndarray,
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_pids: list[int] | None = None,
    ) -> list[Candidate]:
        vector = _unit(vector)
        with self._lock:
            shard = self._shard
            if shard is not None:
                self._readers[id(shard)] = self._readers.get(id(shard), 0) + 1
            if self._by_tenant is None:
                self._by_tenant = _tenant_deltas(self._delta, self.dim, self._shard_pids)
            delta = self._by_tenant.get(visibility.tenant)
        # Both are immutable snapshots taken together: search them outside the lock.
        try:
            found = delta.search(vector, visibility, k, only_pids) if delta is not None else []
            if shard is not None:
                found += self._shard_search(
                    shard,
                    vector,
                    visibility,
                    k,
                    hnsw_ef,
                    only_pids,
                    exclude=delta.shadow_ids if delta is not None else set(),
                )
        finally:
            if shard is not None:
                with self._lock:
                    remaining = self._readers.pop(id(shard)) - 1
                    if remaining:
                        self._readers[id(shard)] = remaining
                if self._retired:
                    self._release_retired()
        found.sort(key=lambda c: -c.score)
        return found[:k]

    @staticmethod
    def _shard_search(shard, vector, visibility, limit, hnsw_ef, only_pids, exclude):
        query = ShardQuery(
            vector=vector,
            tenant=visibility.tenant,
            scopes=tuple(visibility.allowed_scopes),
            attribute_terms=tuple(visibility.attribute_terms),
            limit=limit,
            hnsw_ef=hnsw_ef,
            only_pids=tuple(only_pids) if only_pids is not None else None,
            exclude=tuple(exclude),
        )
        return [Candidate(pid, score) for pid, score in shard.query(query)]

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
        for shard, _ in self._retired:
            shard.close()
        self._retired = []
        if self._shard is not None:
            self._shard.close()
