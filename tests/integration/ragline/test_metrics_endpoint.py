"""A service's Prometheus endpoint: gRPC server metrics by method and status code, named as
py-grpc-prometheus names them, served by the real process on its metrics port."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline.processes import free_ports
from ragline.v1 import budget_pb2, budget_pb2_grpc
from support.metrics import scrape

pytestmark = pytest.mark.integration


def handled(found, method: str) -> dict[str, float]:
    """grpc_code -> calls of `method` handled."""
    return {
        s.labels["grpc_code"]: s.value
        for s in found["grpc_server_handled"]
        if s.name.endswith("_total") and s.labels["grpc_method"] == method
    }


def test_a_service_counts_its_calls_by_method_and_code(launcher, etcd):
    metrics_port = free_ports(1)[0]
    handle = launcher.start(
        "budget",
        env={
            "RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint,
            "RAGLINE_BUDGET_METRICS_PORT": str(metrics_port),
        },
    )

    async def calls():
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = budget_pb2_grpc.BudgetServiceStub(channel)
            metadata = (("x-ragline-tenant", "acme"),)
            for _ in range(3):  # a task nobody opened
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.GetLedger(
                        budget_pb2.GetLedgerRequest(task_id="nobody"), timeout=5, metadata=metadata
                    )
            with pytest.raises(grpc.aio.AioRpcError) as bad:  # no task id at all
                await stub.GetLedger(budget_pb2.GetLedgerRequest(), timeout=5, metadata=metadata)
            return caught.value.code().name, bad.value.code().name

    missing, invalid = asyncio.run(calls())
    found = scrape(metrics_port)
    assert handled(found, "GetLedger") == {missing: 3.0, invalid: 1.0}
    assert invalid == "INVALID_ARGUMENT"
    started = [
        s
        for s in found["grpc_server_started"]
        if s.name.endswith("_total") and s.labels["grpc_method"] == "GetLedger"
    ]
    assert [(s.labels["grpc_service"], s.labels["grpc_type"], s.value) for s in started] == [
        ("ragline.v1.BudgetService", "unary", 4.0)
    ]
    count = next(
        s
        for s in found["grpc_server_handling_seconds"]
        if s.name.endswith("_count") and s.labels["grpc_method"] == "GetLedger"
    )
    assert count.value == 4
    # Health checks are the load balancer's, not the service's traffic: not counted.
    assert not any(s.labels["grpc_service"].startswith("grpc.") for s in started)
    assert f'"metrics_port": {metrics_port}' in handle.log()


def test_metrics_are_off_unless_a_port_is_set(launcher, etcd):
    handle = launcher.start("budget", env={"RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint})
    assert "metrics.listening" not in handle.log()
