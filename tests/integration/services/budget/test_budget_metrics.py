"""The budget service's own metrics, read from its /metrics after real ledger operations on
etcd: operations by result (ok, replayed, the refusal's reason), etcd's latency by operation,
conflicts, and whether etcd answers."""

from __future__ import annotations

import grpc
import pytest

from ragline.processes import free_ports
from support.budget import Api, budget_env, new_id
from support.metrics import sample_values, scrape

pytestmark = pytest.mark.integration


async def test_operations_are_counted_by_result_and_etcd_is_timed(launcher, etcd):
    port = free_ports(1)[0]
    budget = launcher.start("budget", env=budget_env(etcd, RAGLINE_BUDGET_METRICS_PORT=str(port)))
    task = new_id("task")
    async with grpc.aio.insecure_channel(budget.address) as channel:
        api = Api(channel, new_id("tenant"))
        await api.open(task, calls=2)
        await api.reserve(task, "r1", calls=1)
        await api.reserve(task, "r1", calls=1)  # the same id again: replayed
        await api.reserve(task, "r2", calls=1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.reserve(task, "r3", calls=1)  # the task's two calls are taken
        await api.settle(task, "r1", calls=1)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    found = scrape(port)
    assert sample_values(found, "ragline_budget_operations", "_total") == {
        ("open_task", "ok"): 1.0,
        ("reserve", "ok"): 2.0,
        ("reserve", "replayed"): 1.0,
        ("reserve", "BUDGET_EXHAUSTED"): 1.0,
        ("settle", "ok"): 1.0,
    }
    etcd_calls = sample_values(found, "ragline_budget_etcd_seconds", "_count")
    assert etcd_calls[("write", "ok")] >= 4  # open, two grants, a settle
    assert etcd_calls[("ping", "ok")] >= 1  # the health probe
    assert sample_values(found, "ragline_budget_etcd_reachable") == {(): 1.0}
    assert sample_values(found, "ragline_budget_conflicts", "_total") == {(): 0.0}
