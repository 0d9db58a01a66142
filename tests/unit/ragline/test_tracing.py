"""The kit's tracing switch: off unless OTEL_TRACES_EXPORTER names an exporter, a clear error
for one it cannot use, and spans written as JSON lines with parents and the W3C context."""

from __future__ import annotations

import json
import time

import pytest

from ragline import tracing


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    yield monkeypatch
    tracing.shutdown()


def test_off_by_default_and_then_nothing_is_made(clean):
    assert not tracing.configure("budget")
    assert not tracing.enabled()
    assert tracing.inject() == [] and tracing.trace_id() == ""
    assert tracing.record("x", 1.0, 2.0) is None and tracing.client_span("a.B", "C") is None
    with tracing.span("y") as made:
        assert made is None


def test_an_exporter_it_cannot_use_is_named(clean):
    clean.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(tracing.TracingConfigError, match="zipkin"):
        tracing.configure("budget")
    clean.setenv("OTEL_TRACES_EXPORTER", "jsonl")
    with pytest.raises(tracing.TracingConfigError, match="RAGLINE_TRACES_FILE"):
        tracing.configure("budget")


def test_spans_go_to_the_file_with_their_parents_and_context(clean, tmp_path):
    clean.setenv("OTEL_TRACES_EXPORTER", "jsonl")
    path = tmp_path / "spans.jsonl"
    assert tracing.configure("budget", path)
    assert tracing.record("orphan", 1.0, 2.0) is None  # outside any call: nothing
    call = tracing.ServerSpan("/ragline.v1.BudgetService/Reserve", [], time.monotonic())
    with tracing.span("outer") as outer:
        metadata = dict(tracing.inject())
        inner = tracing.record("inner", 10.0, 10.5)
        trace_id = tracing.trace_id()
    call.end("OK", 0, time.monotonic(), server_fault=False)
    assert metadata["traceparent"].split("-")[1] == trace_id == call.trace_id
    tracing.shutdown()  # exports what is pending
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert spans["inner"]["parent_id"] == spans["outer"]["context"]["span_id"]
    assert (
        spans["outer"]["parent_id"]
        == spans["ragline.v1.BudgetService/Reserve"]["context"]["span_id"]
    )
    assert spans["outer"]["resource"]["attributes"]["service.name"] == "ragline-budget"
    assert outer is not None and inner is not None


def test_below_a_trace_the_sampler_did_not_keep_nothing_is_made(clean, tmp_path):
    clean.setenv("OTEL_TRACES_EXPORTER", "jsonl")
    clean.setenv("OTEL_TRACES_SAMPLER", "always_off")
    path = tmp_path / "spans.jsonl"
    assert tracing.configure("budget", path)
    call = tracing.ServerSpan("/ragline.v1.BudgetService/Reserve", [], time.monotonic())
    with tracing.span("engine") as engine:
        assert engine is None and tracing.record("run", 1.0, 2.0) is None
        assert tracing.client_span("ragline.v1.X", "Y") is None
        flags = tracing.inject()[0][1].rsplit("-", 1)[1]
        assert int(flags, 16) & 1 == 0  # unsampled, as said downstream
    call.end("OK", 0, time.monotonic(), server_fault=False)
    tracing.shutdown()
    assert not path.exists() or path.read_text() == ""


def test_readings_a_known_time_apart_stay_that_far_apart_when_the_clock_reads_are_slow(
    monkeypatch,
):
    # A thread switch between reading the wall clock and the monotonic one (a busy CI
    # machine) must not shift one span against another: two readings 0.2 s apart convert
    # to wall-clock times 0.2 s apart, however slow each wall-clock read is.
    real_time_ns, delays = time.time_ns, iter([0.0, 0.004] * 50)

    def slow_time_ns() -> int:
        now = real_time_ns()
        time.sleep(next(delays))
        return now

    monkeypatch.setattr(tracing, "_wall_clock", tracing._WallClockAnchor())
    monkeypatch.setattr(time, "time_ns", slow_time_ns)
    started = time.monotonic()
    gaps = [tracing.epoch_ns(started + 0.2) - tracing.epoch_ns(started) for _ in range(4)]
    assert all(abs(gap - 200_000_000) <= 1 for gap in gaps), gaps
    # and the converted time is the wall clock's, within the tightest read's bracket
    monkeypatch.setattr(time, "time_ns", real_time_ns)
    assert abs(tracing.epoch_ns(time.monotonic()) - time.time_ns()) < 10_000_000


def test_the_operators_service_name_wins(clean, tmp_path):
    clean.setenv("OTEL_TRACES_EXPORTER", "jsonl")
    clean.setenv("OTEL_SERVICE_NAME", "search-answers")
    path = tmp_path / "spans.jsonl"
    assert tracing.configure("budget", path)
    call = tracing.ServerSpan("/ragline.v1.BudgetService/Reserve", [], time.monotonic())
    call.end("OK", 0, time.monotonic(), server_fault=False)
    tracing.shutdown()
    (span,) = map(json.loads, path.read_text().splitlines())
    assert span["resource"]["attributes"]["service.name"] == "search-answers"
