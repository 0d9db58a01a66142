"""Talking to the budget service in tests: a stub bound to one tenant, ids, settings."""

from __future__ import annotations

import uuid
from pathlib import Path

from ragline.v1 import budget_pb2, budget_pb2_grpc, common_pb2


def budget_env(etcd, **extra) -> dict[str, str]:
    return {
        "RAGLINE_BUDGET_ETCD_ENDPOINTS": etcd.endpoint,
        "RAGLINE_BUDGET_HEALTH_PROBE_S": "0.3",
        **extra,
    }


class Api:
    """The budget stub bound to one tenant."""

    def __init__(self, channel, tenant: str) -> None:
        self.stub = budget_pb2_grpc.BudgetServiceStub(channel)
        self.metadata = (("x-ragline-tenant", tenant),)

    async def open(self, task_id, timeout_s=60.0, max_in_flight=0, **limits):
        request = budget_pb2.OpenTaskRequest(
            task_id=task_id, limits=common_pb2.BudgetAmounts(**limits), max_in_flight=max_in_flight
        )
        request.timeout.FromNanoseconds(int(timeout_s * 1e9))
        return await self.stub.OpenTask(request, timeout=10, metadata=self.metadata)

    async def reserve(self, task_id, rid, **amounts):
        return await self.stub.Reserve(
            budget_pb2.ReserveRequest(
                task_id=task_id, reservation_id=rid, amounts=common_pb2.BudgetAmounts(**amounts)
            ),
            timeout=10,
            metadata=self.metadata,
        )

    async def settle(self, task_id, rid, failed=False, **actual):
        return await self.stub.Settle(
            budget_pb2.SettleRequest(
                task_id=task_id,
                reservation_id=rid,
                actual=common_pb2.BudgetAmounts(**actual),
                failed=failed,
            ),
            timeout=10,
            metadata=self.metadata,
        )

    async def cancel(self, task_id, rid):
        return await self.stub.Cancel(
            budget_pb2.CancelRequest(task_id=task_id, reservation_id=rid, reason="test"),
            timeout=10,
            metadata=self.metadata,
        )

    async def ledger(self, task_id, include_reservations=False):
        return await self.stub.GetLedger(
            budget_pb2.GetLedgerRequest(task_id=task_id, include_reservations=include_reservations),
            timeout=10,
            metadata=self.metadata,
        )


def new_id(prefix="t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


BUDGET_HAMMER = Path(__file__).with_name("budget_hammer.py")
