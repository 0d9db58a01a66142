"""`ragline top`'s arithmetic: rates and quantiles from the change between two scrapes of
real exposition text (a process's own registry), and the frame it draws."""

from __future__ import annotations

import io

from prometheus_client import generate_latest
from rich.console import Console

from ragline.metrics import UNARY, ProcessMetrics
from ragline_app.top import Scrape, parse, quantile, row, table


def exposition(metrics: ProcessMetrics, at: float) -> Scrape:
    return parse(generate_latest(metrics.registry).decode(), at)


def test_a_quantile_interpolates_inside_its_bucket_of_what_changed():
    before = {0.1: 10.0, 0.5: 10.0, 1.0: 10.0, float("inf"): 10.0}
    after = {0.1: 10.0, 0.5: 60.0, 1.0: 110.0, float("inf"): 110.0}  # 100 new: 50 + 50
    assert quantile(0.5, before, after) == 0.5
    assert abs(quantile(0.75, before, after) - 0.75) < 1e-9
    assert quantile(0.5, after, after) is None  # nothing observed in between


def test_calls_errors_and_latency_come_from_the_change_between_scrapes():
    metrics = ProcessMetrics()
    grpc = metrics.grpc
    for _ in range(5):  # before the first scrape: not counted
        grpc.call_finished(grpc.call_started("/ragline.v1.X/Slow", UNARY), "OK", 9.0)
    before = exposition(metrics, at=100.0)
    for code, seconds in [("OK", 0.004)] * 18 + [("UNAVAILABLE", 0.004), ("NOT_FOUND", 0.004)]:
        grpc.call_finished(grpc.call_started("/ragline.v1.X/Fast", UNARY), code, seconds)
    grpc.call_started("/ragline.v1.X/Fast", UNARY)  # still running
    after = exposition(metrics, at=110.0)

    seen = row("x", before, after)
    assert seen.calls_per_s == 2.0  # 20 finished in 10 s
    assert seen.errors_per_s == 0.1  # UNAVAILABLE only: NOT_FOUND is the caller's
    assert 0.0025 < seen.p95_s <= 0.005  # the 5 slow calls before the first scrape left out
    assert seen.in_flight == 1


def test_service_rows_read_their_own_state_and_a_down_one_says_so():
    metrics = ProcessMetrics()
    metrics.reading("ragline_generation_slots", "s", labels=("tier",)).add(lambda: 2, "small")
    metrics.reading("ragline_generation_slots_busy", "b", labels=("tier",)).add(lambda: 1, "small")
    metrics.reading("ragline_generation_requests_waiting", "w", labels=("tier",)).add(
        lambda: 3, "small"
    )
    scraped = exposition(metrics, at=1.0)
    generation = row("generation", scraped, scraped)
    assert generation.busy == (1, 2) and generation.queue == 3
    down = row("rerank", scraped, Scrape(2.0, error="Connection refused"))
    assert not down.up and "refused" in down.note

    console = Console(file=io.StringIO(), width=140)
    console.print(table([generation, down], interval_s=2))
    drawn = console.file.getvalue()
    assert "1/2 slots" in drawn and "down: Connection refused" in drawn


def test_the_gateway_row_counts_http_requests_and_its_own_failures():
    from ragline_services.gateway.service import RequestMetrics

    metrics = ProcessMetrics()
    http = RequestMetrics(metrics, app=None)
    before = exposition(metrics, at=0.0)
    for status, seconds in [("200", 0.02)] * 16 + [("429", 0.001)] * 2 + [("503", 0.01)] * 2:
        http.requests.labels("/v1/chat/completions", status).inc()
        http.seconds.labels("/v1/chat/completions").observe(seconds)
    after = exposition(metrics, at=10.0)

    gateway = row("gateway", before, after)
    assert gateway.calls_per_s == 2.0  # 20 requests in 10 s
    assert gateway.errors_per_s == 0.2  # the 503s; a 429 is the caller's to retry
    assert 0.01 < gateway.p50_s <= 0.025 and gateway.note == "HTTP"
