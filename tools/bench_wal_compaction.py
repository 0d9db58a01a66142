"""Does the retrieval write log stay bounded under a steady overwrite load?

    .venv/bin/python tools/bench_wal_compaction.py [--rounds 60] [--docs 100] [--compact-mb 1]

Starts a retrieval service (and the embedding service it needs) with
RAGLINE_RETRIEVAL_WAL_COMPACT_MB=--compact-mb, then rewrites the same `--docs` documents
(~2 KB of text and a caller vector each) `--rounds` times. Reported: the bytes written in
all, the log's size sampled after every round (largest and last), and the same run's
documents, still searchable at their last version. Without compaction the log holds every
version ever written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ragline.identity import WRITE_SCOPE
from ragline.v1 import common_pb2, retrieval_pb2, retrieval_pb2_grpc
from ragline_app.stack import spawn_service

WRITER = (("x-ragline-tenant", "bench"), ("x-ragline-scopes", WRITE_SCOPE))


async def main(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as work:
        index_dir = Path(work) / "index"
        embedding, embedding_addr = spawn_service("embedding", {}, Path(work) / "e.log")
        retrieval, address = spawn_service(
            "retrieval",
            {
                "RAGLINE_EMBEDDING_ADDR": embedding_addr,
                "RAGLINE_RETRIEVAL_INDEX_DIR": str(index_dir),
                "RAGLINE_RETRIEVAL_WAL_COMPACT_MB": str(args.compact_mb),
                "RAGLINE_RETRIEVAL_BUILD_CHECK_S": "0.5",
            },
            Path(work) / "r.log",
        )
        sizes, written = [], 0
        started = time.monotonic()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
                for round_ in range(args.rounds):
                    request = retrieval_pb2.UpsertRequest(
                        documents=[
                            common_pb2.Document(
                                id=f"doc-{n}",
                                title="",
                                text=f"round {round_} document {n} " + "lorem ipsum " * 170,
                                vector=rng.normal(size=384).tolist(),
                            )
                            for n in range(args.docs)
                        ]
                    )
                    written += request.ByteSize()
                    await stub.Upsert(request, timeout=60, metadata=WRITER)
                    await asyncio.sleep(0.1)
                    sizes.append((index_dir / "write.log").stat().st_size)
                await asyncio.sleep(1.5)  # a last check of the compaction
                sizes.append((index_dir / "write.log").stat().st_size)
                found = await stub.Search(
                    retrieval_pb2.SearchRequest(
                        query=f"round {args.rounds - 1} document 7",
                        k=1,
                        mode=retrieval_pb2.SEARCH_MODE_BM25,
                    ),
                    timeout=30,
                    metadata=WRITER,
                )
        finally:
            for process in (retrieval, embedding):
                process.terminate()
                process.wait()
    mib = 1 << 20
    return {
        "rounds": args.rounds,
        "docs": args.docs,
        "compact_mb": args.compact_mb,
        "written_mib": round(written / mib, 1),
        "log_largest_mib": round(max(sizes) / mib, 2),
        "log_last_mib": round(sizes[-1] / mib, 2),
        "seconds": round(time.monotonic() - started, 1),
        "last_version_found": [(h.id, h.version) for h in found.hits],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--compact-mb", type=int, default=1)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
