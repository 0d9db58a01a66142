"""Builds an HNSW shard (qdrant-edge) from the write log, in its own process.

    python -m ragline_services.retrieval.hnsw_builder WAL UPTO_SEQ TARGET_DIR DIM

Replays the log up to UPTO_SEQ (last version of each document wins, deletions remove it),
writes every live vector with its filter payload into a new shard and runs Qdrant's
optimizer to build the HNSW segments. Prints the number of points. Running apart from the
service keeps the build off the query path and off the service's interpreter.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ragline_services.retrieval.documents import StoredDocument
from ragline_services.retrieval.vectors import HNSW_EF_CONSTRUCT, HNSW_M, point_id
from ragline_services.retrieval.wal import WriteLog


def latest_documents(wal: Path, upto_seq: int) -> dict[str, StoredDocument]:
    live: dict[str, StoredDocument] = {}
    for record in WriteLog.read(wal):
        if record["seq"] > upto_seq:
            break
        for key in record.get("deletes", ()):
            live.pop(key, None)
        for item in record.get("upserts", ()):
            doc = StoredDocument.from_record(item)
            live[doc.key] = doc
    return live


def build(wal: Path, upto_seq: int, target: Path, dim: int) -> int:
    import qdrant_edge as qe

    docs = latest_documents(wal, upto_seq)
    config = qe.EdgeConfig(
        vectors=qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine),
        hnsw_config=qe.HnswIndexConfig(
            m=HNSW_M, ef_construct=HNSW_EF_CONSTRUCT, full_scan_threshold=1000
        ),
    )
    target.mkdir(parents=True)
    shard = qe.EdgeShard.create(str(target), config)
    for field in ("tenant", "scope", "attr", "key"):
        shard.update(qe.UpdateOperation.create_field_index(field, qe.PayloadSchemaType.Keyword))
    batch = []
    for doc in docs.values():
        batch.append(qe.Point(point_id(doc.key), list(doc.vector), {
            "key": doc.key, "tenant": doc.tenant, "scope": list(doc.scopes),
            "attr": doc.attribute_terms,
        }))  # fmt: skip
        if len(batch) == 1000:
            shard.update(qe.UpdateOperation.upsert_points(batch))
            batch = []
    if batch:
        shard.update(qe.UpdateOperation.upsert_points(batch))
    shard.optimize()
    shard.flush()
    shard.close()
    return len(docs)


if __name__ == "__main__":
    wal_path, upto, target_dir, dimension = sys.argv[1:5]
    print(build(Path(wal_path), int(upto), Path(target_dir), int(dimension)))
