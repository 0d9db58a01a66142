"""What metrics and traces cost, in one run against both off (issue 38's goals: at most 3%
of HYBRID throughput at concurrency 32, at most 1 ms on Ask's p50 at concurrency 1).

    .venv/bin/python tools/bench_observability.py [--data ../shared/data/squaddev_v1.1.json] \\
        [--passages 400] [--rounds 3] [--search-seconds 20] [--asks 20]

Two stacks (`ragline up --base-port 0`, a data folder each, the same passages ingested):
`off` (no metrics port, no tracing) and `on` (every service serves /metrics, scraped every
5 s as Prometheus would, and exports every span, sampler always on, to a JSON-lines file:
a span's cost in the process is the same whichever exporter takes the batch). Rounds
alternate between the two, so a slow moment of a shared machine falls on both. Measured
per round: RetrievalService.Search in HYBRID mode with the question's text (the retrieval
service embeds it) from 32 concurrent callers for `--search-seconds`, as requests/s; then
`--asks` Asks one at a time (caches bypassed), as p50 seconds. Printed: each variant's
median over the rounds and the ratio on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from ragline import deadlines, identity
from ragline.clients import ChannelPool, ServiceClient
from ragline.v1 import orchestrator_pb2, orchestrator_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from ragline_app.benchmarks import ensure_ingested, start_stack
from ragline_app.datasets import load_squad, write_jsonl

TENANT = "bench-observability"
SCRAPE_EVERY_S = 5.0


class Scraper:
    """Reads every service's /metrics every few seconds on a thread of its own."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.scrapes, self._stop = urls, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            for url in self.urls:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    reply.read()
                self.scrapes += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


async def search_load(address: str, questions: list[str], seconds: float, callers: int) -> float:
    """HYBRID searches per second from `callers` concurrent callers for `seconds`."""
    pool = ChannelPool()
    client = ServiceClient(
        retrieval_pb2_grpc.RetrievalServiceStub,
        address,
        pool=pool,
        caller=identity.Caller(TENANT),
    )
    done = failed = 0
    stop_at = time.monotonic() + seconds

    async def caller(offset: int) -> None:
        nonlocal done, failed
        turn = offset
        while time.monotonic() < stop_at:
            request = retrieval_pb2.SearchRequest(
                query=questions[turn % len(questions)],
                k=10,
                mode=retrieval_pb2.SEARCH_MODE_HYBRID,
            )
            turn += callers
            try:
                with deadlines.deadline_scope(10):
                    await client.unary("Search", request)
                done += 1
            except Exception:
                failed += 1

    started = time.monotonic()
    await asyncio.gather(*(caller(n) for n in range(callers)))
    elapsed = time.monotonic() - started
    await pool.close()
    if failed:
        print(f"  {failed} searches failed", file=sys.stderr)
    return done / elapsed


async def ask_p50(address: str, questions: list[str]) -> float:
    pool = ChannelPool()
    client = ServiceClient(
        orchestrator_pb2_grpc.OrchestratorServiceStub,
        address,
        pool=pool,
        caller=identity.Caller(TENANT),
    )
    times = []
    for question in questions:
        request = orchestrator_pb2.AskRequest(
            question=question, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
        )
        started = time.monotonic()
        with deadlines.deadline_scope(60):
            async for _ in client.stream("Ask", request):
                pass
        times.append(time.monotonic() - started)
    await pool.close()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/squaddev_v1.1.json"))
    parser.add_argument("--passages", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--search-seconds", type=float, default=20.0)
    parser.add_argument("--asks", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args()

    passages, questions = load_squad(args.data)
    rng = random.Random(7)
    chosen = passages[: args.passages]
    kept = {p.id for p in chosen}
    asked = [q.text for q in questions if q.passage_id in kept]
    rng.shuffle(asked)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-observability-"))
    data = write_jsonl(chosen, workdir / "passages.jsonl")
    spans = workdir / "spans.jsonl"
    variants = {
        "off": {"OTEL_TRACES_EXPORTER": "none"},
        "on": {
            "OTEL_TRACES_EXPORTER": "jsonl",
            "RAGLINE_TRACES_FILE": str(spans),
            "OTEL_TRACES_SAMPLER": "always_on",
        },
    }
    stacks, processes = {}, []
    try:
        for name, env in variants.items():
            extra = ["--no-metrics"] if name == "off" else []
            process, addresses = start_stack(workdir / name, env, up_args=extra)
            processes.append(process)
            asyncio.run(ensure_ingested(data, addresses, workdir / name, len(chosen), TENANT))
            state = json.loads((workdir / name / "up.json").read_text())["services"]
            metrics = [s["metrics"] for s in state.values() if s.get("metrics")]
            stacks[name] = (addresses, metrics)
            print(f"{name}: started, {len(metrics)} metrics endpoints", file=sys.stderr)
            asyncio.run(ask_p50(addresses["orchestrator"], asked[:3]))  # warm-up
        results: dict[str, dict[str, list[float]]] = {
            n: {"search_rps": [], "ask_p50_s": []} for n in variants
        }
        for round_number in range(args.rounds):
            for name in variants if round_number % 2 == 0 else reversed(list(variants)):
                addresses, metrics = stacks[name]
                with Scraper(metrics):
                    rps = asyncio.run(
                        search_load(addresses["retrieval"], asked, args.search_seconds, 32)
                    )
                    p50 = asyncio.run(ask_p50(addresses["orchestrator"], asked[: args.asks]))
                results[name]["search_rps"].append(rps)
                results[name]["ask_p50_s"].append(p50)
                print(
                    f"round {round_number + 1} {name}: HYBRID c=32 {rps:.1f}/s, "
                    f"Ask c=1 p50 {p50 * 1000:.0f} ms",
                    file=sys.stderr,
                )
    finally:
        for process in processes:
            process.send_signal(2)
        for process in processes:
            process.wait(timeout=60)
    off, on = results["off"], results["on"]
    rps_off, rps_on = (statistics.median(v["search_rps"]) for v in (off, on))
    p50_off, p50_on = (statistics.median(v["ask_p50_s"]) for v in (off, on))
    span_count = sum(1 for _ in spans.open()) if spans.exists() else 0
    print("| measure | off | on (metrics + traces) | on / off |")
    print("|---|---|---|---|")
    print(
        f"| HYBRID Search, c=32 (requests/s) | {rps_off:.1f} | {rps_on:.1f} | "
        f"{rps_on / rps_off:.3f} |"
    )
    print(
        f"| Ask, c=1, p50 (ms) | {p50_off * 1000:.0f} | {p50_on * 1000:.0f} | "
        f"{(p50_on - p50_off) * 1000:+.1f} ms |"
    )
    print(f"({args.rounds} rounds, medians; {span_count} spans exported by `on`)")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "spans": span_count}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
