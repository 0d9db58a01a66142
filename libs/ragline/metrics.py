"""Prometheus metrics of one service process: a registry of its own, served over HTTP on a
port of its own when the service's `metrics_port` setting is set (off by default on a
laptop; on in the chart).

gRPC server metrics carry the names and labels of py-grpc-prometheus, the convention
grpc-ecosystem's go-grpc-prometheus set and Grafana's gRPC dashboards read:
`grpc_server_started_total`, `grpc_server_handled_total` (with `grpc_code`, the status code's
name), `grpc_server_handling_seconds` (a histogram), each labelled `grpc_type`
(`unary` / `server_stream`), `grpc_service` and `grpc_method`; beside them
`ragline_grpc_server_in_flight`. A service registers its own metrics on `registry`.

A tenant is a label value only when a setting names it (`RAGLINE_METRICS_TENANTS`); every
other tenant is `other`, so a label never grows with the number of tenants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

import ragline

if TYPE_CHECKING:
    from ragline.batching import MicroBatcher

# A `_created` series per counter and histogram doubles what Prometheus stores for a
# timestamp it can infer from the reset itself.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client

UNARY, SERVER_STREAM = "unary", "server_stream"
OTHER_TENANT = "other"
# Seconds: from a cache hit (~1 ms) to a long generation (minutes).
LATENCY_BUCKETS = (
    *(round(scale * step, 4) for scale in (0.001, 0.01, 0.1, 1.0, 10.0) for step in (1, 2.5, 5)),
    120.0,
)
_RPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")


def split_method(full_method: str) -> tuple[str, str]:
    """("ragline.v1.BudgetService", "Reserve") from "/ragline.v1.BudgetService/Reserve"."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or "unknown"


# What a reading returns: one value, or one value per tuple of label values.
Read = Callable[[], "float | dict[tuple[str, ...], float]"]


T = TypeVar("T")


def read_safely(read: Callable[[], T]) -> T | float:
    """A value the event loop changes, read from the scrape's thread: a read torn by a
    change (a dict resized under it) is tried again; NaN when it kept tearing."""
    for _ in range(3):
        try:
            return read()
        except RuntimeError:
            continue
    return float("nan")


class Readings(Collector):
    """A metric whose values are read from live objects when Prometheus scrapes (a queue's
    length, a counter a domain object keeps): the request path records nothing for it.
    Each `add`ed source contributes its samples (several batchers to one family)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: Literal["gauge", "counter"],
        labels: tuple[str, ...] = (),
    ) -> None:
        self.name, self.documentation, self.kind, self.labels = name, documentation, kind, labels
        self._sources: list[tuple[tuple[str, ...], Read]] = []

    def add(self, read: Read, *label_values: str) -> None:
        """`read` gives one value (labelled `label_values`) or a dict from the remaining
        labels' values to values."""
        self._sources.append((label_values, read))

    def _family(self) -> GaugeMetricFamily | CounterMetricFamily:
        family = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        return family(self.name, self.documentation, labels=self.labels)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for fixed, read in self._sources:
            value = read_safely(read)
            rows = value.items() if isinstance(value, dict) else [((), value)]
            for rest, number in rows:
                family.add_metric([*fixed, *rest], float(number))
        yield family


class TenantLabel:
    """The label value of a tenant: itself when named, else `other`."""

    def __init__(self, named: Iterable[str] = ()) -> None:
        self.named = frozenset(t for t in named if t)

    def __call__(self, tenant: str) -> str:
        return tenant if tenant in self.named else OTHER_TENANT


@dataclass(frozen=True)
class RpcLabels:
    grpc_type: str
    grpc_service: str
    grpc_method: str

    def values(self) -> tuple[str, str, str]:
        return self.grpc_type, self.grpc_service, self.grpc_method


class GrpcServerMetrics:
    """What the server interceptor records for every call (health and reflection aside)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter(
            "grpc_server_started_total",
            "RPCs started on the server.",
            _RPC_LABELS,
            registry=registry,
        )
        self.handled = Counter(
            "grpc_server_handled_total",
            "RPCs completed on the server, whatever their status.",
            (*_RPC_LABELS, "grpc_code"),
            registry=registry,
        )
        self.handling_seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from a call's arrival to its last message (seconds).",
            _RPC_LABELS,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "ragline_grpc_server_in_flight",
            "RPCs being handled now.",
            _RPC_LABELS,
            registry=registry,
        )

    def call_started(self, full_method: str, grpc_type: str) -> RpcLabels:
        labels = RpcLabels(grpc_type, *split_method(full_method))
        self.started.labels(*labels.values()).inc()
        self.in_flight.labels(*labels.values()).inc()
        return labels

    def call_finished(self, labels: RpcLabels, code: str, seconds: float) -> None:
        self.in_flight.labels(*labels.values()).dec()
        self.handled.labels(*labels.values(), code).inc()
        self.handling_seconds.labels(*labels.values()).observe(seconds)


class ProcessMetrics:
    """The metrics of one service process."""

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The process's CPU, memory, open files and start time (process_*), Python's
        # version (python_info) and its garbage collector (python_gc_*), as every
        # Prometheus client serves them by default.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # Which build runs where: `count by (version) (ragline_build_info)` during a rollout.
        Gauge(
            "ragline_build_info",
            "The ragline version this process runs (always 1)",
            ("version",),
            registry=self.registry,
        ).labels(ragline.__version__).set(1)
        self.grpc = GrpcServerMetrics(self.registry)
        self.tenant = TenantLabel(tenants)
        self._server: WSGIServer | None = None
        self._readings: dict[str, Readings] = {}
        self._batchers: BatcherMetrics | None = None

    def reading(
        self,
        name: str,
        documentation: str,
        kind: Literal["gauge", "counter"] = "gauge",
        labels: tuple[str, ...] = (),
    ) -> Readings:
        """The process's metric `name` read at scrape time (made on first use, then shared)."""
        if name not in self._readings:
            self._readings[name] = Readings(name, documentation, kind, labels)
            self.registry.register(self._readings[name])
        return self._readings[name]

    @property
    def batchers(self) -> BatcherMetrics:
        """The metrics of the process's micro-batchers (embedding, rerank)."""
        if self._batchers is None:
            self._batchers = BatcherMetrics(self)
        return self._batchers

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics on host:port in a thread of its own (0: a free port); the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# Texts per model run: one (a lone query) to a full bulk batch.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BatcherMetrics:
    """What a micro-batcher (ragline.batching) does, by batcher name: texts per run, run
    time, queue wait by lane; its queue and refusals read at scrape time."""

    def __init__(self, process: ProcessMetrics) -> None:
        registry = process.registry
        self.texts = Histogram(
            "ragline_batch_texts",
            "Texts per model run.",
            ("batcher", "lane"),
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.run_seconds = Histogram(
            "ragline_batch_run_seconds",
            "Time of one model run (all its length buckets).",
            ("batcher", "lane"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "ragline_batch_queue_wait_seconds",
            "Time a request waited in the batcher's queue before its run started.",
            ("batcher", "lane"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self._queued = process.reading(
            "ragline_batch_queued_texts", "Texts waiting for a run now.", labels=("batcher",)
        )
        self._runs = process.reading(
            "ragline_batch_runs_in_flight", "Model runs going on now.", labels=("batcher",)
        )
        self._runners = process.reading(
            "ragline_batch_runners", "Model runs that may go on at once.", labels=("batcher",)
        )
        self._refusals = process.reading(
            "ragline_batch_refusals_total",
            "Requests refused at once because the queue was full (scope: tenant or all).",
            "counter",
            ("batcher", "scope"),
        )
        self._dropped = process.reading(
            "ragline_batch_dropped_total",
            "Requests dropped before compute (reason: cancelled, deadline).",
            "counter",
            ("batcher", "reason"),
        )

    def watch(self, batcher: MicroBatcher) -> None:
        """Records `batcher`'s runs from now on (a ragline.batching.MicroBatcher)."""
        name = batcher.name
        batcher.observer = self
        self._queued.add(lambda: batcher.queued_texts, name)
        self._runs.add(lambda: batcher.runs_in_flight, name)
        self._runners.add(lambda: batcher.max_parallel_runs, name)
        self._refusals.add(lambda: {(k,): v for k, v in dict(batcher.refusals).items()}, name)
        self._dropped.add(lambda: {(k,): v for k, v in dict(batcher.dropped).items()}, name)

    def batch_ran(
        self, batcher: str, lane: str, texts: int, run_s: float, waits: Iterable[float]
    ) -> None:
        self.texts.labels(batcher, lane).observe(texts)
        self.run_seconds.labels(batcher, lane).observe(run_s)
        wait = self.queue_wait.labels(batcher, lane)
        for seconds in waits:
            wait.observe(seconds)
