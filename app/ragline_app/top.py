"""`ragline top`: a live terminal view of every service, read from their /metrics endpoints
(docs/operations.md): calls/s, p50 and p95, errors/s, in flight, queue, busy/capacity and a
cache hit ratio per service, computed from the change between two scrapes.

Where the endpoints are: what a running `ragline up` recorded (up.json), or `--metrics
NAME=URL` for each service (a port-forwarded pod, say).
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Codes that are the caller's business, not the service's failure (the alerts' rule).
CALLER_CODES = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "CANCELLED",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "RESOURCE_EXHAUSTED",
    }
)
SCRAPE_TIMEOUT_S = 2.0
HTTP_REQUESTS = "ragline_gateway_requests_total"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Scrape:
    """One read of one endpoint (or why it failed)."""

    at: float
    samples: list[Sample] = field(default_factory=list)
    error: str = ""

    def total(self, name: str, keep: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return sum(s.value for s in self.samples if s.name == name and keep(s.labels))

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)

    def buckets(self, name: str) -> dict[float, float]:
        """Upper bound -> cumulative count, summed over every label set."""
        out: dict[float, float] = {}
        for s in self.samples:
            if s.name == f"{name}_bucket":
                bound = float(s.labels["le"])
                out[bound] = out.get(bound, 0.0) + s.value
        return out


def parse(text: str, at: float) -> Scrape:
    samples = [
        Sample(s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]
    return Scrape(at, samples)


def scrape(url: str) -> Scrape:
    at = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
            return parse(reply.read().decode(), at)
    except (OSError, ValueError) as error:
        return Scrape(at, error=str(getattr(error, "reason", error)))


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of what a histogram observed between two scrapes, interpolated
    within its bucket as Prometheus's histogram_quantile does; None without observations."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not bounds or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass
class Row:
    service: str
    up: bool
    calls_per_s: float = 0.0
    errors_per_s: float = 0.0
    p50_s: float | None = None
    p95_s: float | None = None
    in_flight: float = 0.0
    queue: float | None = None
    busy: tuple[float, float] | None = None  # in use, capacity
    busy_what: str = ""
    hit_ratio: float | None = None
    hit_what: str = ""
    note: str = ""


def _ratio(hits: float, total: float) -> float | None:
    return hits / total if total > 0 else None


def row(service: str, before: Scrape, after: Scrape) -> Row:
    """What one service did between two scrapes, and its state at the second."""
    if after.error:
        return Row(service, up=False, note=after.error)
    seconds = max(after.at - before.at, 1e-6)

    def delta(name: str, keep: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return max(after.total(name, keep) - before.total(name, keep), 0.0)

    if after.has(HTTP_REQUESTS):
        # An HTTP service (the gateway): requests, and its own failures (5xx; a 4xx is
        # the caller's, as a caller's gRPC codes are)
        handled, timing = HTTP_REQUESTS, "ragline_gateway_request_seconds"

        def failed(labels: dict[str, str]) -> bool:
            return labels["status"].startswith("5")
    else:
        handled, timing = "grpc_server_handled_total", "grpc_server_handling_seconds"

        def failed(labels: dict[str, str]) -> bool:
            return labels["grpc_code"] not in CALLER_CODES

    out = Row(
        service,
        up=True,
        calls_per_s=delta(handled) / seconds,
        errors_per_s=delta(handled, failed) / seconds,
        p50_s=quantile(0.5, before.buckets(timing), after.buckets(timing)),
        p95_s=quantile(0.95, before.buckets(timing), after.buckets(timing)),
        in_flight=after.total("ragline_grpc_server_in_flight"),
    )
    _add_service_state(out, after, lambda name: delta(name) / seconds)
    return out


def _add_service_state(out: Row, after: Scrape, rate: Callable[[str], float]) -> None:
    """What the second scrape says of the service's own queue, busy places and cache, known
    by the metrics it serves (orchestrator, generation, a batcher, retrieval, budget);
    `rate(name)`: a counter's rate between the scrapes."""
    if after.has(HTTP_REQUESTS):
        out.note = "HTTP"
    elif after.has("ragline_orchestrator_run_places"):
        out.queue = after.total("ragline_orchestrator_runs_waiting")
        out.busy = (
            after.total("ragline_orchestrator_runs_in_flight"),
            after.total("ragline_orchestrator_run_places"),
        )
        out.busy_what = "runs"
        lookups = "ragline_orchestrator_cache_lookups_total"

        def answer(labels: dict[str, str]) -> bool:
            return labels["cache"] == "answer" and labels["result"] == "hit"

        out.hit_ratio = _ratio(
            after.total(lookups, answer),
            after.total(lookups, lambda labels: labels["cache"] == "answer"),
        )
        out.hit_what = "answers"
    elif after.has("ragline_generation_slots"):
        out.queue = after.total("ragline_generation_requests_waiting")
        out.busy = (
            after.total("ragline_generation_slots_busy"),
            after.total("ragline_generation_slots"),
        )
        out.busy_what = "slots"
        events = "ragline_generation_prefix_store_events_total"
        out.hit_ratio = _ratio(
            after.total(events, lambda labels: labels["event"] == "hits"),
            after.total(events, lambda labels: labels["event"] == "lookups"),
        )
        out.hit_what = "KV prefixes"
    elif after.has("ragline_batch_runners"):
        out.queue = after.total("ragline_batch_queued_texts")
        out.busy = (
            after.total("ragline_batch_runs_in_flight"),
            after.total("ragline_batch_runners"),
        )
        out.busy_what = "model runs"
        lookups = "ragline_rerank_token_cache_lookups_total"
        if after.has(lookups):
            out.hit_ratio = _ratio(
                after.total(lookups, lambda labels: labels["result"] == "hit"),
                after.total(lookups),
            )
            out.hit_what = "token vectors"
    elif after.has("ragline_retrieval_documents"):
        out.queue = after.total("ragline_retrieval_apply_lag_writes")
        out.note = f"{after.total('ragline_retrieval_documents'):.0f} documents"
    elif after.has("ragline_budget_etcd_reachable"):
        reachable = after.total("ragline_budget_etcd_reachable") >= 1
        conflicts = rate("ragline_budget_conflicts_total")
        out.note = ("etcd ok" if reachable else "ETCD UNREACHABLE") + (
            f", {conflicts:.1f} conflicts/s" if conflicts else ""
        )


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def table(rows: Iterable[Row], interval_s: float):
    """The rows as a rich Table."""
    from rich.table import Table

    out = Table(
        title=f"ragline top (change over the last {interval_s:.0f} s; Ctrl-C quits)",
        title_justify="left",
    )
    numbers = ("calls/s", "p50", "p95", "errors/s", "in flight", "queue", "busy", "cache hits")
    out.add_column("service", justify="left")
    for column in numbers:
        out.add_column(column, justify="right")
    out.add_column("", justify="left")
    for r in rows:
        if not r.up:
            out.add_row(r.service, *["-"] * 8, f"[red]down: {r.note}[/red]")
            continue
        busy = f"{r.busy[0]:.0f}/{r.busy[1]:.0f} {r.busy_what}" if r.busy else "-"
        hits = f"{r.hit_ratio:.0%} {r.hit_what}" if r.hit_ratio is not None else "-"
        errors = f"{r.errors_per_s:.2f}"
        out.add_row(
            r.service,
            f"{r.calls_per_s:.1f}",
            _ms(r.p50_s),
            _ms(r.p95_s),
            f"[red]{errors}[/red]" if r.errors_per_s else errors,
            f"{r.in_flight:.0f}",
            "-" if r.queue is None else f"{r.queue:.0f}",
            busy,
            hits,
            r.note,
        )
    return out


def scrape_all(endpoints: dict[str, str], pool: ThreadPoolExecutor) -> dict[str, Scrape]:
    return dict(zip(endpoints, pool.map(scrape, endpoints.values()), strict=True))


def run(endpoints: dict[str, str], interval_s: float, frames: int | None = None) -> None:
    """Redraws every `interval_s` (`frames`: stop after that many, else on Ctrl-C)."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:
        before = scrape_all(endpoints, pool)
        time.sleep(interval_s)
        after = scrape_all(endpoints, pool)

        def frame():
            return table([row(name, before[name], after[name]) for name in endpoints], interval_s)

        if frames == 1:
            console.print(frame())
            return
        shown = 1
        with Live(frame(), console=console, auto_refresh=False) as live:
            while frames is None or shown < frames:
                time.sleep(interval_s)
                before, after = after, scrape_all(endpoints, pool)
                live.update(frame(), refresh=True)
                shown += 1
