"""Rerank latency per cascade stage, through gRPC, at 20 and 100 candidates.

    .venv/bin/python tools/bench_rerank.py [--data ../shared/data/squaddev_v1.1.json] \\
        [--queries 100] [--candidates 20,100] [--concurrency 1,8] [--baseline DIR]

Starts the rerank service (its defaults: the embedding model's token vectors for late
interaction, ragline's cross-encoder) and asks SQuAD questions over candidate lists of
each size (the question's own paragraph and others of its article and of other articles).
Reports, per size: the server's stage timings (`late_interaction`, `cross_encoder`) p50/p95
with the candidates' token vectors cached (warm: the usual case, since a retrieval list
repeats documents) and on first sight (cold: computed now), the whole call p50/p95, and
queries/s at each concurrency (pairs batched across requests), and last the warm stage 1
and call once more with the query prepared ahead (`Prepare` with the query, then `Rerank`:
what the orchestrator's plan does, encoding the question while retrieval runs; "-" for a
baseline whose Prepare takes no query). Stage 1 alone is measured
with the cross-encoder turned off (a second service, RAGLINE_RERANK_CROSS_ENCODER_MODEL="").
`--baseline DIR` (another checkout, with its own defaults) runs every row twice in one run,
that code's services first, so before and after share the machine's state.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from ragline.v1 import rerank_pb2, rerank_pb2_grpc
from ragline_app.datasets import load_squad
from ragline_app.stack import source_pythonpath, spawn_service

REPO = Path(__file__).resolve().parents[1]
ACME = (("x-ragline-tenant", "bench"),)


def requests_for(passages, questions, size: int, count: int, seed: int):
    rng = random.Random(seed)
    chosen = rng.sample(questions, count)
    by_id = {p.id: p for p in passages}
    out = []
    for q in chosen:
        others = rng.sample([p for p in passages if p.id != q.passage_id], size - 1)
        pool = [by_id[q.passage_id], *others]
        rng.shuffle(pool)
        out.append(
            rerank_pb2.RerankRequest(
                query=q.text,
                candidates=[
                    rerank_pb2.RerankCandidate(id=p.id, text=f"{p.title}. {p.text}") for p in pool
                ],
                top_k=5,
                late_interaction_k=20,
            )
        )
    return out


async def run(address: str, requests, concurrency: int, *, prepare_query: bool = False):
    stages: dict[str, list[float]] = {}
    totals: list[float] = []
    queue = list(requests)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)

        async def worker():
            while queue:
                request = queue.pop(0)
                if prepare_query:
                    ahead = rerank_pb2.PrepareRequest(query=request.query)
                    try:
                        await stub.Prepare(ahead, timeout=60, metadata=ACME)
                    except grpc.aio.AioRpcError:
                        queue.clear()  # this code's Prepare takes no query
                        return
                started = time.perf_counter()
                reply = await stub.Rerank(request, timeout=60, metadata=ACME)
                totals.append(time.perf_counter() - started)
                for stage in reply.timing.stages:
                    stages.setdefault(stage.name, []).append(stage.duration.ToNanoseconds() / 1e9)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return stages, totals, len(requests) / wall


def p(values) -> str:
    if not values:
        return "-"
    a, b = np.percentile(np.asarray(values) * 1000, [50, 95])
    return f"{a:.1f} / {b:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--data", type=Path, default=REPO / "app/ragline_app/data/squad_dev_sample.json"
    )
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--candidates", default="20,100")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout, measured first")
    args = parser.parse_args()
    passages, questions = load_squad(args.data)
    logs = REPO / ".ragline" / "bench"
    variants = (
        [("before", {"PYTHONPATH": source_pythonpath(args.baseline)})] if args.baseline else []
    )
    variants.append(("after" if args.baseline else "this tree", {}))
    rows = []
    # A fresh token store per run: "cold" means first sight, not read back from an
    # earlier run's disk.
    scratch = Path(tempfile.mkdtemp(prefix="bench-rerank-"))
    variants = [
        (name, {**env, "RAGLINE_RERANK_TOKEN_STORE_DIR": str(scratch / name.replace(" ", "-"))})
        for name, env in variants
    ]
    for variant, env in variants:
        full, full_addr = spawn_service("rerank", env, logs / f"bench-rerank-{variant}.log")
        stage1, stage1_addr = spawn_service(
            "rerank",
            {
                **env,
                "RAGLINE_RERANK_CROSS_ENCODER_MODEL": "",
                "RAGLINE_RERANK_TOKEN_STORE_DIR": env["RAGLINE_RERANK_TOKEN_STORE_DIR"] + "-1",
            },
            logs / f"bench-rerank-stage1-{variant}.log",
        )
        try:
            for size in (int(s) for s in args.candidates.split(",")):
                requests = requests_for(passages, questions, size, args.queries, args.seed + size)
                for name, address in (("stage 1", stage1_addr), ("stage 1+2", full_addr)):
                    cold_stages, cold_totals, _ = asyncio.run(run(address, requests, 1))
                    warm_stages, warm_totals, _ = asyncio.run(run(address, requests, 1))
                    rates = {
                        c: asyncio.run(run(address, requests, c))[2]
                        for c in (int(x) for x in args.concurrency.split(","))
                    }
                    # Last: a prepared query stays kept ~30 s and would speed up the rows
                    # above.
                    ready_stages, ready_totals, _ = asyncio.run(
                        run(address, requests, 1, prepare_query=True)
                    )
                    rows.append(
                        f"| {variant} | {size} | {name} | "
                        f"{p(warm_stages.get('late_interaction'))} | "
                        f"{p(warm_stages.get('cross_encoder'))} | {p(warm_totals)} | "
                        f"{p(cold_stages.get('late_interaction'))} | {p(cold_totals)} | "
                        f"{p(ready_stages.get('late_interaction'))} | {p(ready_totals)} | "
                        + " / ".join(f"{r:.1f}" for r in rates.values())
                        + " |"
                    )
                    print(rows[-1], file=sys.stderr)
        finally:
            for process in (full, stage1):
                process.terminate()
                process.wait(timeout=30)
    print(f"{args.queries} questions of {args.data.name}; ms p50 / p95; server stage timings")
    levels = args.concurrency.replace(",", "/")
    print(
        "| code | candidates | cascade | late interaction (warm) | cross-encoder | call (warm) | "
        "late interaction (cold) | call (cold) | late interaction (query prepared) | "
        f"call (query prepared) | queries/s at c={levels} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
