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

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

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
        self.grpc = GrpcServerMetrics(self.registry)
        self.tenant = TenantLabel(tenants)
        self._server = None

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics on host:port in a thread of its own (0: a free port); the port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
