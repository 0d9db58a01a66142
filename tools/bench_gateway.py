"""What the HTTP gateway adds: the same Ask through gRPC and through HTTP, one run.

    .venv/bin/python tools/bench_gateway.py [--asks 200] [--concurrency 16] [--json out.json]

Starts `ragline up` (its own data folder) and ingests the demo corpus, then:

1. **Overhead**: one question answered once (stored in the answer cache), then asked
   `--asks` times alternately through the orchestrator's gRPC Ask and the gateway's
   `POST /v1/chat/completions` (whole), both hitting the cache, so the difference of the
   medians is the gateway's own time (HTTP parsing, translation, one more hop on loopback).
2. **Load**: `--concurrency` clients at once send the demo questions through the gateway
   (answer cache bypassed: real generation), each with a 60 s timeout, the OpenAI SDK's
   retry on 429 (it honours Retry-After), and counts what did not end 200.

Prints both tables; `--json` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import httpx

from ragline.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from ragline.vocabulary import CachePolicy
from ragline_app.benchmarks import ensure_ingested, start_stack
from ragline_app.ingest import DEMO_CORPUS

REPO = Path(__file__).resolve().parents[1]
QUESTION = "Which river flows through Warsaw?"
LOAD_QUESTIONS = [
    "Which river flows through Warsaw?",
    "What religion were the Normans?",
    "Who was the duke in the battle of Hastings?",
    "When was Warsaw's Royal Castle rebuilt?",
    "What is the largest city in Poland?",
    "Where is Normandy?",
    "What is the name of the Warsaw stock exchange?",
    "Who founded the Normans?",
]
METADATA = (("x-ragline-tenant", "default"),)


async def grpc_ask(stub, question: str) -> float:
    started = time.perf_counter()
    async for _ in stub.Ask(
        orchestrator_pb2.AskRequest(question=question), timeout=60, metadata=METADATA
    ):
        pass
    return time.perf_counter() - started


async def http_ask(http: httpx.AsyncClient, question: str, **ragline) -> tuple[float, int]:
    started = time.perf_counter()
    body = {"model": "ragline", "messages": [{"role": "user", "content": question}]}
    if ragline:
        body["ragline"] = ragline
    for _attempt in range(3):  # the OpenAI SDK's default: two retries on 429
        reply = await http.post("/v1/chat/completions", json=body)
        if reply.status_code != 429:
            break
        await asyncio.sleep(float(reply.headers.get("retry-after", "1")))
    return time.perf_counter() - started, reply.status_code


async def overhead(orchestrator: str, gateway: str, asks: int) -> dict:
    async with (
        grpc.aio.insecure_channel(orchestrator) as channel,
        httpx.AsyncClient(base_url=f"http://{gateway}", timeout=60) as http,
    ):
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        await grpc_ask(stub, QUESTION)  # answered once: the answer cache holds it
        for _ in range(5):  # connections made, code paths warm
            await grpc_ask(stub, QUESTION)
            await http_ask(http, QUESTION)
        through_grpc, through_http = [], []
        for _ in range(asks // 2):
            through_grpc.append(await grpc_ask(stub, QUESTION))
            seconds, status = await http_ask(http, QUESTION)
            assert status == 200, status
            through_http.append(seconds)
    p50_grpc = statistics.median(through_grpc) * 1000
    p50_http = statistics.median(through_http) * 1000
    return {
        "asks_each": len(through_grpc),
        "grpc_p50_ms": round(p50_grpc, 2),
        "http_p50_ms": round(p50_http, 2),
        "overhead_p50_ms": round(p50_http - p50_grpc, 2),
    }


async def load(gateway: str, concurrency: int, per_client: int) -> dict:
    statuses: dict[int, int] = {}
    times: list[float] = []
    async with httpx.AsyncClient(
        base_url=f"http://{gateway}",
        timeout=60,
        limits=httpx.Limits(max_connections=concurrency),
        headers={"X-Ragline-Timeout": "60"},
    ) as http:

        async def client(number: int) -> None:
            for i in range(per_client):
                question = LOAD_QUESTIONS[(number + i) % len(LOAD_QUESTIONS)]
                try:
                    seconds, status = await http_ask(http, question, cache=CachePolicy.BYPASS)
                except httpx.HTTPError:
                    seconds, status = 60.0, 0
                statuses[status] = statuses.get(status, 0) + 1
                times.append(seconds)

        started = time.perf_counter()
        await asyncio.gather(*(client(n) for n in range(concurrency)))
        wall = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "requests": len(times),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "failed": sum(v for k, v in statuses.items() if k != 200),
        "answers_per_s": round(statuses.get(200, 0) / wall, 3),
        "p50_s": round(statistics.median(times), 2),
        "p95_s": round(sorted(times)[int(0.95 * (len(times) - 1))], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--asks", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO / ".ragline" / "bench-gateway")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    process, addresses = start_stack(args.workdir, {})
    try:
        asyncio.run(ensure_ingested(DEMO_CORPUS, addresses, args.workdir, 203, "default"))
        measured = asyncio.run(overhead(addresses["orchestrator"], addresses["gateway"], args.asks))
        loaded = asyncio.run(load(addresses["gateway"], args.concurrency, args.per_client))
    finally:
        process.terminate()
        process.wait(timeout=60)
    print("| Ask (answer cached), p50 | gRPC | HTTP gateway | gateway overhead |")
    print("|---|---|---|---|")
    print(
        f"| {measured['asks_each']} each, alternating | {measured['grpc_p50_ms']:.2f} ms | "
        f"{measured['http_p50_ms']:.2f} ms | {measured['overhead_p50_ms']:.2f} ms |"
    )
    print()
    print("| clients | requests | statuses | failed | answers/s | p50 / p95 |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {loaded['concurrency']} | {loaded['requests']} | {loaded['statuses']} | "
        f"{loaded['failed']} | {loaded['answers_per_s']} | {loaded['p50_s']} / "
        f"{loaded['p95_s']} s |"
    )
    if args.json:
        args.json.write_text(json.dumps({"overhead": measured, "load": loaded}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
