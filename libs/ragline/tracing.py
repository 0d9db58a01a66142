"""OpenTelemetry traces of one service process (docs/operations.md, "Traces").

Off unless `OTEL_TRACES_EXPORTER` names an exporter: `otlp` (OTLP over gRPC, configured by
the standard `OTEL_EXPORTER_OTLP_*` variables), `console`, or `jsonl` (one JSON span per
line appended to `RAGLINE_TRACES_FILE`: tests, and a laptop without a collector). The
standard variables hold as the SDK reads them: `OTEL_SERVICE_NAME` (default
`ragline-<service>`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` (default: always on,
or as the caller's trace decided), `OTEL_BSP_*` (batching of exports).

Context crosses every hop as W3C `traceparent` in the call's metadata: the kit's client
injects it, the server interceptor extracts it and opens the call's span. Spans of work
measured after the fact (a plan node, a batch's queue wait and model run) are recorded
with the timestamps the timing report uses, so the two agree.

While off, every function here returns at once: no span, no context, no allocation worth
measuring on the request path.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind as SpanKind  # part of this module's span() API
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACE_ID_KEY = "x-ragline-trace-id"
EXPORTERS = ("otlp", "console", "jsonl")
_PROPAGATOR = TraceContextTextMapPropagator()
_provider = None  # the SDK's TracerProvider while tracing is on
_tracer: trace.Tracer | None = None


class TracingConfigError(ValueError):
    """OTEL_TRACES_EXPORTER or RAGLINE_TRACES_FILE cannot be used (said at start)."""


class JsonLinesExporter:
    """Appends each finished span as one JSON line (the SDK's own JSON of a span) to a
    file; several processes may share the file (one write per line, appended)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(json.loads(span.to_json())) + "\n" for span in spans)
        with self._lock, self._path.open("a") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _exporter(name: str, traces_file: Path | None) -> SpanExporter:
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == "jsonl":
        if traces_file is None:
            raise TracingConfigError(
                "OTEL_TRACES_EXPORTER=jsonl needs RAGLINE_TRACES_FILE (where spans go)"
            )
        # The SDK's exporter interface, implemented without importing the SDK at module
        # import (a process with tracing off never loads it).
        return cast("SpanExporter", JsonLinesExporter(traces_file))
    raise TracingConfigError(
        f"OTEL_TRACES_EXPORTER={name!r} is not one of {', '.join(EXPORTERS)} (or none)"
    )


def configure(service: str, traces_file: Path | None = None) -> bool:
    """Turns tracing on for this process when OTEL_TRACES_EXPORTER asks; whether it did."""
    global _provider, _tracer
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names or names == ["none"] or os.environ.get("OTEL_SDK_DISABLED") == "true":
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = [_exporter(name, traces_file) for name in names if name != "none"]
    # The operator's OTEL_SERVICE_NAME wins (Resource.create would let ours override it).
    name = os.environ.get("OTEL_SERVICE_NAME", "").strip() or f"ragline-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("ragline")
    return True


def shutdown() -> None:
    """Exports what is pending (blocking: call it off the event loop)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def enabled() -> bool:
    return _tracer is not None


def _sampled(parent: trace.Span | None = None) -> bool:
    """Whether a child of `parent` (default: the current span) is recorded. Only a call's
    server span asks the sampler; below a trace it did not keep, nothing is made at all
    (what a parent-based sampler would decide, without the cost of asking)."""
    span_context = (parent or trace.get_current_span()).get_span_context()
    return span_context.is_valid and span_context.trace_flags.sampled


def sampled() -> bool:
    """Whether the current trace is recorded (tracing on and the trace kept)."""
    return _tracer is not None and _sampled()


class _WallClockAnchor:
    """The wall clock's offset from time.monotonic(), read rarely and tightly.

    Reading both clocks at every conversion let a thread switch between the two reads
    shift one span against another by a millisecond or more, so the spans of one ask
    disagreed with its timing report. The offset is read as the tightest of a few
    bracketed pairs and kept for a minute (NTP's slewing moves it by microseconds in
    that time; a stepped clock is followed at the next reading)."""

    REREAD_AFTER_S = 60.0
    TRIES = 5

    def __init__(self) -> None:
        self._read_at = -float("inf")
        self._offset_ns = 0

    def offset_ns(self) -> int:
        now = time.monotonic()
        if now - self._read_at > self.REREAD_AFTER_S:
            self._offset_ns, self._read_at = self.measure(), now
        return self._offset_ns

    @classmethod
    def measure(cls) -> int:
        best_width, best_offset = None, 0
        for _ in range(cls.TRIES):
            before = time.monotonic_ns()
            wall = time.time_ns()
            after = time.monotonic_ns()
            if best_width is None or after - before < best_width:
                best_width, best_offset = after - before, wall - (before + after) // 2
        return best_offset


_wall_clock = _WallClockAnchor()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds a span records."""
    return round(monotonic_s * 1e9) + _wall_clock.offset_ns()


def inject(made: trace.Span | None = None) -> list[tuple[str, str]]:
    """The trace context of `made` (default: the current span) as call metadata
    (`traceparent`, `tracestate`)."""
    if _tracer is None:
        return []
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(made) if made else None)
    return list(carrier.items())


def client_span(service: str, method: str) -> trace.Span | None:
    """The span of one outgoing call (`ragline.v1.EmbeddingService`, `Embed`), child of the
    current span; not made current (a stream's consumer runs between its messages), so
    pass it to `inject`."""
    if _tracer is None or not _sampled():
        return None
    return _tracer.start_span(
        f"{service}/{method}",
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
    )


def end_client_span(made: trace.Span | None, error: BaseException | None = None) -> None:
    if made is None:
        return
    if error is not None:
        code_of = getattr(error, "code", None)
        code = code_of() if callable(code_of) else None
        # Not a gRPC error (a cancelled task, a bug): UNKNOWN, as grpc's own rule has it.
        made.set_attribute("rpc.grpc.status_code", code.value[0] if code else 2)
        made.set_status(Status(StatusCode.ERROR, code.name if code else type(error).__name__))
    else:
        made.set_attribute("rpc.grpc.status_code", 0)
    made.end()


def trace_id() -> str:
    """The current trace's id (32 hex digits), or "" outside one."""
    span_context = trace.get_current_span().get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


class ServerSpan:
    """The span of one incoming call, its context made current until `end`."""

    def __init__(self, name: str, metadata: Sequence[tuple[str, str]] | None, received: float):
        carrier = {k: v for k, v in metadata or () if k in ("traceparent", "tracestate")}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        service, _, method = name.lstrip("/").rpartition("/")
        assert _tracer is not None, "a server span is made only while tracing is on"
        self.span = _tracer.start_span(
            f"{service}/{method}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=epoch_ns(received),
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
        )
        self._token = otel_context.attach(trace.set_span_in_context(self.span))

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def end(self, code: str, code_number: int, finished: float, server_fault: bool) -> None:
        self.span.set_attribute("rpc.grpc.status_code", code_number)
        if server_fault:
            self.span.set_status(Status(StatusCode.ERROR, code))
        self.span.end(end_time=epoch_ns(finished))
        with contextlib.suppress(ValueError):  # a stream closed from another context
            otel_context.detach(self._token)


@contextlib.contextmanager
def http_server_span(
    method: str, route: str, headers: Mapping[str, str]
) -> Iterator[trace.Span | None]:
    """The span of one incoming HTTP request (the gateway), child of the caller's
    `traceparent` when it sent one, current inside the block (its gRPC calls are its
    children); nothing while tracing is off."""
    if _tracer is None:
        yield None
        return
    carrier = {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k))}
    parent = _PROPAGATOR.extract(carrier) if carrier else None
    made = _tracer.start_span(
        f"{method} {route}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "http.route": route},
    )
    token = otel_context.attach(trace.set_span_in_context(made))
    try:
        yield made
    finally:
        with contextlib.suppress(ValueError):
            otel_context.detach(token)
        made.end()


@contextlib.contextmanager
def span(
    name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes = None
) -> Iterator[trace.Span | None]:
    """A child span of the current one around a block (an engine's call), or nothing
    while tracing is off or the trace is not kept. An exception ends it with an error
    status."""
    if _tracer is None or not _sampled():
        yield None
        return
    with _tracer.start_as_current_span(name, kind=kind, attributes=attributes) as current:
        yield current


def record(
    name: str,
    started: float,
    finished: float,
    attributes: Attributes = None,
    *,
    error: str = "",
    parent: trace.Span | None = None,
) -> trace.Span | None:
    """A span measured after the fact (time.monotonic() readings), child of `parent` or of
    the current span; returned so that later ones can hang under it."""
    made = start(name, started, attributes, parent=parent)
    finish(made, finished, error)
    return made


def start(
    name: str, started: float, attributes: Attributes = None, *, parent: trace.Span | None = None
) -> trace.Span | None:
    """A span that began at `started` (a monotonic reading) and ends later (`finish`)."""
    if _tracer is None or not _sampled(parent):
        return None
    context = trace.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(
        name, context=context, start_time=epoch_ns(started), attributes=attributes
    )


def finish(made: trace.Span | None, finished: float, error: str = "") -> None:
    if made is None:
        return
    if error:
        made.set_status(Status(StatusCode.ERROR, error))
    made.end(end_time=epoch_ns(finished))


@contextlib.contextmanager
def current(made: trace.Span | None) -> Iterator[None]:
    """`made` as the current span inside the block (calls made there are its children)."""
    if made is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(made))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            otel_context.detach(token)
