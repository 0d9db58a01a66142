"""What metrics and traces cost, in one run against both off (issue 38's goals: at most 3%
of HYBRID throughput at concurrency 32, at most 1 ms on Ask's p50 at concurrency 1).

    .venv/bin/python tools/bench_observability.py [--data ../shared/data/squaddev_v1.1.json] \\
        [--passages 400] [--rounds 3] [--search-seconds 20] [--asks 40] \\
        [--variants off,metrics,traces,on] [--exporter otlp|jsonl]

A stack per variant (`ragline up --base-port 0`, a data folder each, the same passages
ingested): `off` (no metrics port, no tracing) and `on` (every service serves /metrics,
scraped every 5 s as Prometheus would, and exports every span, sampler always on, by OTLP
to a collector stand-in in this process). Rounds alternate between them, so a slow moment
of a shared machine falls on all. Measured per round: RetrievalService.Search in HYBRID
mode with the question's text (the retrieval service embeds it) from 32 concurrent callers
for `--search-seconds`, as requests/s; after the rounds, `--asks` questions each asked of
every variant in turn, one at a time (caches bypassed): the p50 of each, and the median of
each question's difference from `off` (a question's own time, its answer's length, falls
on all). Printed: each variant's median over the rounds and the ratio to `off`.
`--variants` adds `metrics` (metrics only) and `traces` (traces only); `--exporter otlp`
(default) sends spans to a collector stand-in, a process of its own that drops them;
`jsonl` appends them to a file.
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
from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from ragline_app.benchmarks import ask_pairs, ensure_ingested, start_stack
from ragline_app.datasets import load_squad, write_jsonl
from ragline_app.eval_data import eval_file

TENANT = "bench-observability"
SCRAPE_EVERY_S = 5.0


def _serve_otlp(port, spans, ready) -> None:
    """The collector stand-in's process: counts the spans of each export and drops them."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            count = sum(
                len(scope.spans)
                for resource in request.resource_spans
                for scope in resource.scope_spans
            )
            with spans.get_lock():
                spans.value += count
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port.value = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.set()
    server.wait_for_termination()


class OtlpSink:
    """A collector stand-in: an OTLP/gRPC trace endpoint in a process of its own (decoding
    what the stack exports costs CPU that must not slow the load generator)."""

    def __init__(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._port, self._spans = context.Value("i", 0), context.Value("q", 0)
        ready = context.Event()
        self._process = context.Process(
            target=_serve_otlp, args=(self._port, self._spans, ready), daemon=True
        )
        self._process.start()
        ready.wait(60)
        self.port = self._port.value

    @property
    def spans(self) -> int:
        return self._spans.value

    def close(self) -> None:
        self._process.terminate()


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=eval_file("squaddev_v1.1.json"))
    parser.add_argument("--passages", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--search-seconds", type=float, default=20.0)
    parser.add_argument("--asks", type=int, default=40)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument(
        "--variants",
        default="off,on",
        help="of off, off-again (the same: the noise floor), metrics (metrics only), traces "
        "(traces only), on (both), on-sampled (both, a tenth of traces sampled: the chart's "
        "default)",
    )
    parser.add_argument(
        "--exporter",
        default="otlp",
        choices=("otlp", "jsonl"),
        help="otlp: to a collector stand-in in this process that drops what it gets",
    )
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
    sink = None
    traced = {
        "OTEL_TRACES_EXPORTER": args.exporter,
        "RAGLINE_TRACES_FILE": str(spans),
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    if args.exporter == "otlp":
        sink = OtlpSink()
        traced["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink.port}"
        traced["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    # name -> (environment, metrics served)
    # the chart's default sampling (values.yaml tracing.sampler): a tenth of new traces
    sampled = {
        **traced,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    }
    every = {
        "off": ({"OTEL_TRACES_EXPORTER": "none"}, False),
        # the same as off: how far two identical stacks differ (the noise floor)
        "off-again": ({"OTEL_TRACES_EXPORTER": "none"}, False),
        "metrics": ({"OTEL_TRACES_EXPORTER": "none"}, True),
        "traces": (traced, False),
        "on": (traced, True),
        "on-sampled": (sampled, True),
    }
    variants = {name: every[name] for name in args.variants.split(",")}
    stacks, processes = {}, []
    try:
        for name, (env, served) in variants.items():
            extra = [] if served else ["--no-metrics"]
            # Generation sizes its slots from the memory free at start: fixed, so that a
            # stack started later is not given fewer or shorter slots.
            env = {**env, "RAGLINE_GENERATION_MEMORY_BUDGET_MB": "3072"}
            process, addresses = start_stack(workdir / name, env, up_args=extra)
            processes.append(process)
            asyncio.run(ensure_ingested(data, addresses, workdir / name, len(chosen), TENANT))
            state = json.loads((workdir / name / "up.json").read_text())["services"]
            metrics = [s["metrics"] for s in state.values() if s.get("metrics")]
            stacks[name] = (addresses, metrics)
            print(f"{name}: started, {len(metrics)} metrics endpoints", file=sys.stderr)
            asyncio.run(
                ask_pairs({name: (addresses["orchestrator"], None)}, asked[:3], TENANT)
            )  # warm-up
        results: dict[str, dict[str, list[float]]] = {
            n: {"search_rps": [], "ask_s": []} for n in variants
        }
        for round_number in range(args.rounds):
            for name in variants if round_number % 2 == 0 else reversed(list(variants)):
                addresses, metrics = stacks[name]
                with Scraper(metrics):
                    rps = asyncio.run(
                        search_load(addresses["retrieval"], asked, args.search_seconds, 32)
                    )
                results[name]["search_rps"].append(rps)
                print(f"round {round_number + 1} {name}: HYBRID c=32 {rps:.1f}/s", file=sys.stderr)
        scrapers = [Scraper(stacks[name][1]) for name in variants]
        for scraper in scrapers:
            scraper.__enter__()
        try:
            paired = asyncio.run(
                ask_pairs(
                    {name: (stacks[name][0]["orchestrator"], None) for name in variants},
                    asked[3 : 3 + args.asks],
                    TENANT,
                )
            )
        finally:
            for scraper in scrapers:
                scraper.__exit__()
        for name, seconds in paired.items():
            results[name]["ask_s"] = seconds
    finally:
        for process in processes:
            process.send_signal(2)
        for process in processes:
            process.wait(timeout=60)
    rps = {n: statistics.median(v["search_rps"]) for n, v in results.items()}
    p50 = {n: statistics.median(v["ask_s"]) for n, v in results.items()}
    # the median of each question's own difference: what the variant adds to one Ask
    added = {
        n: statistics.median(
            b - a for a, b in zip(results["off"]["ask_s"], results[n]["ask_s"], strict=True)
        )
        for n in results
    }
    names = [n for n in variants if n != "off"]
    print("| measure | off | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    print(
        f"| HYBRID Search, c=32 (requests/s) | {rps['off']:.1f} | "
        + " | ".join(f"{rps[n]:.1f} ({rps[n] / rps['off']:.3f})" for n in names)
        + " |"
    )
    print(
        f"| Ask, c=1, p50 (ms) | {p50['off'] * 1000:.0f} | "
        + " | ".join(f"{p50[n] * 1000:.0f}" for n in names)
        + " |"
    )
    print(
        "| Ask, c=1, median of each question's difference (ms) | 0 | "
        + " | ".join(f"{added[n] * 1000:+.2f}" for n in names)
        + " |"
    )
    exported = sink.spans if sink is not None else None
    if sink is not None:
        sink.close()
    if exported is None and spans.exists():
        exported = sum(1 for _ in spans.open())
    print(f"({args.rounds} rounds, medians; {exported} spans exported, by {args.exporter})")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "spans": exported}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
