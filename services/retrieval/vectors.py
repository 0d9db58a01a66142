"""Vector search behind one interface, on Qdrant's engine either way.

- EdgeVectorIndex: `qdrant-edge-py`, Qdrant's shard engine in process (embedded default).
  Upserts land in an appendable segment that is searched exactly at once; `optimize()`
  builds the HNSW segments in the background and Qdrant swaps them in atomically.
- QdrantServerIndex (qdrant_server.py): a Qdrant cluster through qdrant-client over gRPC.

Both store, per point: the document key, tenant, scopes and attribute terms as payload,
and filter on them in the engine (never after the fact), with cosine distance and the same
HNSW settings (m=16, ef_construct=200).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ragline_services.retrieval.documents import Candidate, StoredDocument, Visibility

HNSW_M = 16
HNSW_EF_CONSTRUCT = 200


def point_id(key: str) -> int:
    """A stable 63-bit point id for a document key (the key is also kept in the payload)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class VectorIndexStatus:
    points: int
    indexed_points: int  # inside HNSW segments; the rest is searched exactly
    segments: int


class VectorIndex(Protocol):
    dim: int

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None: ...

    def search(
        self,
        vector: list[float],
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_keys: list[str] | None = None,
    ) -> list[Candidate]: ...

    def build(self) -> None:
        """(Re)builds the HNSW index; queries keep being answered meanwhile."""

    def status(self) -> VectorIndexStatus: ...

    def close(self) -> None: ...


class EdgeVectorIndex:
    def __init__(self, directory: Path, dim: int, *, full_scan_threshold: int = 10_000) -> None:
        import qdrant_edge as qe

        self._qe = qe
        self.dim = dim
        config = qe.EdgeConfig(
            vectors=qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine),
            hnsw_config=qe.HnswIndexConfig(
                m=HNSW_M,
                ef_construct=HNSW_EF_CONSTRUCT,
                full_scan_threshold=full_scan_threshold,
            ),
        )
        directory.mkdir(parents=True, exist_ok=True)
        if any(directory.iterdir()):
            self.shard = qe.EdgeShard.load(str(directory))
        else:
            self.shard = qe.EdgeShard.create(str(directory), config)
            for field in ("tenant", "scope", "attr", "key"):
                self.shard.update(qe.UpdateOperation.create_field_index(
                    field, qe.PayloadSchemaType.Keyword))  # fmt: skip
        self._build_lock = threading.Lock()

    def apply(self, upserts: list[StoredDocument], deletes: list[str]) -> None:
        qe = self._qe
        if deletes:
            self.shard.update(qe.UpdateOperation.delete_points([point_id(k) for k in deletes]))
        if upserts:
            points = [
                qe.Point(
                    point_id(doc.key),
                    list(doc.vector),
                    {
                        "key": doc.key,
                        "tenant": doc.tenant,
                        "scope": list(doc.scopes),
                        "attr": doc.attribute_terms,
                    },
                )
                for doc in upserts
            ]
            self.shard.update(qe.UpdateOperation.upsert_points(points))

    def _filter(self, visibility: Visibility, only_keys: list[str] | None):
        qe = self._qe
        must = [
            qe.FieldCondition(key="tenant", match=qe.MatchValue(visibility.tenant)),
            qe.FieldCondition(key="scope", match=qe.MatchAny(visibility.allowed_scopes)),
        ]
        for term in visibility.attribute_terms:
            must.append(qe.FieldCondition(key="attr", match=qe.MatchValue(term)))
        if only_keys is not None:
            must.append(qe.FieldCondition(key="key", match=qe.MatchAny(only_keys)))
        return qe.Filter(must=must)

    def search(
        self,
        vector: list[float],
        visibility: Visibility,
        k: int,
        hnsw_ef: int,
        only_keys: list[str] | None = None,
    ) -> list[Candidate]:
        qe = self._qe
        request = qe.QueryRequest(
            limit=k,
            query=qe.Query.Nearest(list(vector)),
            filter=self._filter(visibility, only_keys),
            with_payload=True,
            params=qe.SearchParams(hnsw_ef=hnsw_ef, exact=only_keys is not None),
        )
        return [
            Candidate(point.payload["key"], float(point.score))
            for point in self.shard.query(request)
        ]

    def build(self) -> None:
        with self._build_lock:
            self.shard.optimize()

    def status(self) -> VectorIndexStatus:
        info = self.shard.info()
        return VectorIndexStatus(
            points=int(info.points_count or 0),
            indexed_points=int(info.indexed_vectors_count or 0),
            segments=int(info.segments_count or 0),
        )

    def flush(self) -> None:
        self.shard.flush()

    def close(self) -> None:
        self.shard.close()
