"""Builds an HNSW shard (qdrant-edge) from the write log, in its own process.

    python -m ragline_services.retrieval.hnsw_builder WAL UPTO_SEQ TARGET_DIR DIM \
        [--threads N] [--niceness N] [--idle]

Replays the log up to UPTO_SEQ (last version of each document wins, deletions remove it),
writes every live vector with its filter payload into a new shard and runs Qdrant's
optimizer to build the HNSW segments. Prints the number of points and writes their ids,
sorted, to `point_ids.npy` in its directory (the service excludes only the delta keys the
shard really holds: an exclusion list cost a query ~1.2 ms at 3,000 ids). Running apart
from the service keeps the build off the query path and off the service's interpreter; it
runs at low CPU priority on few threads because on a small node the queries share its cores
(measured on 2 cores: a build on all cores at normal priority made the hybrid p99 6.6x
its steady value).

Low priority means Linux's SCHED_IDLE class (`--idle`): a core runs the build only when
nothing else wants it. Niceness alone is not enough: qdrant's build thread sets its own
niceness, and where it may (root, or a permissive RLIMIT_NICE) it raised itself from 19 to
9 (seen in `ps -L`: `hnsw-build-0` at NI 9 in a process at 19), which on 2 cores doubled
the vector search's p50 while it ran. A thread in the idle class stays there when its
niceness changes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from ragline.files import fsync_tree
from ragline_services.retrieval.documents import point_id
from ragline_services.retrieval.vectors import HNSW_EF_CONSTRUCT, HNSW_M, POINT_IDS_FILE
from ragline_services.retrieval.wal import live_documents


def build(wal: Path, upto_seq: int, target: Path, dim: int, threads: int = 1) -> int:
    import qdrant_edge as qe

    config = qe.EdgeConfig(
        vectors=qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine),
        hnsw_config=qe.HnswIndexConfig(
            m=HNSW_M,
            ef_construct=HNSW_EF_CONSTRUCT,
            full_scan_threshold=1000,
            max_indexing_threads=threads,
        ),
    )
    target.mkdir(parents=True)
    shard = qe.EdgeShard.create(str(target), config)
    for field in ("tenant", "scope", "attr", "key"):
        shard.update(qe.UpdateOperation.create_field_index(field, qe.PayloadSchemaType.Keyword))
    batch, ids = [], []
    for doc in live_documents(wal, upto_seq):
        ids.append(point_id(doc.key))
        batch.append(
            qe.Point(
                point_id(doc.key),
                doc.vector.tolist(),
                {
                    "key": doc.key,
                    "tenant": doc.tenant,
                    "scope": list(doc.scopes),
                    "attr": doc.attribute_terms,
                },
            )
        )
        if len(batch) == 1000:
            shard.update(qe.UpdateOperation.upsert_points(batch))
            batch = []
    if batch:
        shard.update(qe.UpdateOperation.upsert_points(batch))
    shard.optimize()
    shard.flush()
    shard.close()
    np.save(target / POINT_IDS_FILE, np.sort(np.array(ids, dtype=np.int64)))
    # The service points current.json at this directory next: it must be on disk first,
    # or a power loss leaves the manifest naming a shard that is not there.
    fsync_tree(target)
    return len(ids)


def lower_priority(niceness: int, idle: bool) -> str:
    """Lowers the CPU priority of every thread of this process (threads started at import,
    such as a BLAS pool, included; later ones inherit it); returns the class they run in."""
    linux = os.path.isdir("/proc/self/task")
    tasks = [int(tid) for tid in os.listdir("/proc/self/task")] if linux else [0]
    in_idle = idle and hasattr(os, "sched_setscheduler")
    for tid in tasks:
        try:
            if niceness:  # also what applies where the idle class is not available
                current = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, max(niceness, current))
            if in_idle:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that has ended meanwhile
        except PermissionError:
            in_idle = False
    return "idle" if in_idle else "normal"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("wal", type=Path)
    parser.add_argument("upto_seq", type=int)
    parser.add_argument("target", type=Path)
    parser.add_argument("dim", type=int)
    parser.add_argument("--threads", type=int, default=1, help="0: every core")
    parser.add_argument("--niceness", type=int, default=19)
    parser.add_argument("--idle", action="store_true", help="Linux's SCHED_IDLE class")
    args = parser.parse_args()
    lower_priority(args.niceness, args.idle)
    print(build(args.wal, args.upto_seq, args.target, args.dim, args.threads))


if __name__ == "__main__":
    main()
