"""Service process lifecycle: graceful SIGTERM, draining health, loud port clashes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc
import pytest

from ragline.v1 import budget_pb2, budget_pb2_grpc

pytestmark = pytest.mark.integration


def test_sigterm_stops_cleanly_and_logs_json(launcher):
    handle = launcher.start("rerank")
    handle.process.send_signal(signal.SIGTERM)
    assert handle.process.wait(timeout=15) == 0
    log = handle.log()
    assert '"event": "service.stopping"' in log and '"event": "service.stopped"' in log


def test_sigint_stops_cleanly(launcher):
    handle = launcher.start("orchestrator")
    handle.process.send_signal(signal.SIGINT)
    assert handle.process.wait(timeout=15) == 0


def test_a_busy_port_fails_loudly(launcher):
    first = launcher.start("embedding")
    clash = subprocess.run(
        [sys.executable, "-m", "ragline_app.cli", "serve", "embedding", "--port", str(first.port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert clash.returncode == 1
    assert f"cannot listen on 127.0.0.1:{first.port}" in clash.stderr


def test_access_log_carries_run_id_tenant_and_method(launcher, etcd):
    handle = launcher.start("budget", env={"RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint})

    async def call():
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = budget_pb2_grpc.BudgetServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.GetLedger(
                    budget_pb2.GetLedgerRequest(task_id="t1"),
                    timeout=5,
                    metadata=(("x-ragline-tenant", "acme"), ("x-ragline-run-id", "run-42")),
                )

    asyncio.run(call())
    handle.stop()
    lines = [line for line in handle.log().splitlines() if '"method": "/ragline.' in line]
    assert lines, handle.log()
    assert '"run_id": "run-42"' in lines[-1]
    assert '"tenant": "acme"' in lines[-1]
    assert '"method": "/ragline.v1.BudgetService/GetLedger"' in lines[-1]
