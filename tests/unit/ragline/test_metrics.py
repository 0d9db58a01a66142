"""The kit's metrics: py-grpc-prometheus names, bounded tenant labels, an HTTP endpoint."""

from __future__ import annotations

import urllib.request

from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from ragline.metrics import OTHER_TENANT, UNARY, ProcessMetrics, TenantLabel, split_method


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_a_method_splits_into_its_service_and_name():
    assert split_method("/ragline.v1.BudgetService/Reserve") == (
        "ragline.v1.BudgetService",
        "Reserve",
    )
    assert split_method("odd") == ("unknown", "odd")


def test_only_the_named_tenants_are_label_values():
    label = TenantLabel(["acme", ""])
    assert label("acme") == "acme"
    assert label("globex") == label("") == OTHER_TENANT
    metrics = ProcessMetrics(tenants=["acme"])
    asks = Counter("asks_total", "asks", ["tenant"], registry=metrics.registry)
    for number in range(1000):
        asks.labels(metrics.tenant(f"tenant-{number}")).inc()
    asks.labels(metrics.tenant("acme")).inc()
    values = {
        s.labels["tenant"]: s.value for s in asks.collect()[0].samples if s.name.endswith("_total")
    }
    assert values == {"other": 1000.0, "acme": 1.0}


def test_the_endpoint_serves_grpc_server_metrics_by_method_and_code():
    metrics = ProcessMetrics()
    port = metrics.serve("127.0.0.1", 0)
    try:
        labels = metrics.grpc.call_started("/ragline.v1.BudgetService/Reserve", UNARY)
        assert scrape(port)["ragline_grpc_server_in_flight"][0].value == 1
        metrics.grpc.call_finished(labels, "INVALID_ARGUMENT", 0.003)
        found = scrape(port)
        handled = [s for s in found["grpc_server_handled"] if s.name.endswith("_total")]
        assert [(s.labels, s.value) for s in handled] == [
            (
                {
                    "grpc_type": "unary",
                    "grpc_service": "ragline.v1.BudgetService",
                    "grpc_method": "Reserve",
                    "grpc_code": "INVALID_ARGUMENT",
                },
                1.0,
            )
        ]
        started = [s for s in found["grpc_server_started"] if s.name.endswith("_total")]
        assert started[0].value == 1
        count = next(s for s in found["grpc_server_handling_seconds"] if s.name.endswith("_count"))
        assert count.value == 1
        assert found["ragline_grpc_server_in_flight"][0].value == 0
    finally:
        metrics.close()
