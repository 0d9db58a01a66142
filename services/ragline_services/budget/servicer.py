"""BudgetService servicer: translates protobuf <-> ledger domain types, nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import grpc
import structlog
from google.protobuf import timestamp_pb2

from ragline.budget import Amounts
from ragline.errors import to_rpc_status
from ragline.identity import current_caller
from ragline.v1 import budget_pb2, budget_pb2_grpc
from ragline_services.budget.ledger import Outcome, TaskLedger
from ragline_services.budget.metrics import BudgetMetrics, reason_of, result_of
from ragline_services.budget.records import (
    PENDING,
    RESERVED,
    SETTLED,
    TASK_CLOSED,
    TASK_EXPIRED,
    TASK_OPEN,
    ReservationRecord,
    TaskRecord,
)

log = structlog.get_logger("ragline.budget")
T = TypeVar("T")

_TASK_STATES = {
    TASK_OPEN: budget_pb2.TASK_STATE_OPEN,
    TASK_CLOSED: budget_pb2.TASK_STATE_CLOSED,
    TASK_EXPIRED: budget_pb2.TASK_STATE_EXPIRED,
}
_RESERVATION_STATES = {
    RESERVED: budget_pb2.RESERVATION_STATE_RESERVED,
    PENDING: budget_pb2.RESERVATION_STATE_PENDING,
    SETTLED: budget_pb2.RESERVATION_STATE_SETTLED,
}


def _timestamp(ns: int) -> timestamp_pb2.Timestamp:
    value = timestamp_pb2.Timestamp()
    value.FromNanoseconds(ns)
    return value


def ledger_proto(
    task: TaskRecord, revision: int, now_ns: int, reservations=()
) -> budget_pb2.Ledger:
    return budget_pb2.Ledger(
        task_id=task.task_id,
        state=_TASK_STATES[task.state_at(now_ns)],
        limits=task.limits.to_proto(),
        reserved=task.reserved.to_proto(),
        pending=task.pending.to_proto(),
        used=task.used.to_proto(),
        remaining=task.remaining.to_proto(),
        in_flight=task.in_flight,
        max_in_flight=task.max_in_flight,
        deadline=_timestamp(task.deadline_ns),
        reservations=[reservation_proto(task.task_id, r) for r in reservations],
        revision=revision,
    )


def reservation_proto(task_id: str, record: ReservationRecord) -> budget_pb2.Reservation:
    message = budget_pb2.Reservation(
        task_id=task_id,
        reservation_id=record.reservation_id,
        state=_RESERVATION_STATES[record.state],
        amounts=record.amounts.to_proto(),
        stage=record.stage,
        failed=record.failed,
        created_at=_timestamp(record.created_ns),
    )
    if record.actual is not None:
        message.actual.CopyFrom(record.actual.to_proto())
    if record.settled_ns:
        message.settled_at.CopyFrom(_timestamp(record.settled_ns))
    return message


class BudgetServicer(budget_pb2_grpc.BudgetServiceServicer):
    def __init__(self, ledger: TaskLedger) -> None:
        self.ledger = ledger
        self.metrics: BudgetMetrics | None = None  # when the process serves metrics

    async def _counted(self, operation: str, call: Awaitable[T]) -> T:
        """`call`'s result, its outcome counted by operation (a Batch's items one by one)."""
        if self.metrics is None:
            return await call
        try:
            result = await call
        except Exception as error:
            self.metrics.done(operation, reason_of(error))
            raise
        self.metrics.done(operation, result_of(result))
        return result

    def _outcome(self, outcome: Outcome, task_id: str):
        assert outcome.reservation is not None, "a reservation's operation answers with it"
        return (
            reservation_proto(task_id, outcome.reservation),
            ledger_proto(outcome.task, outcome.revision, self.ledger.now_ns()),
        )

    async def OpenTask(
        self, request: budget_pb2.OpenTaskRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.OpenTaskResponse:
        task, revision, created = await self._counted(
            "open_task",
            self.ledger.open_task(
                current_caller().tenant,
                request.task_id,
                Amounts.from_proto(request.limits),
                request.max_in_flight,
                request.timeout.ToNanoseconds() / 1e9,
            ),
        )
        return budget_pb2.OpenTaskResponse(
            ledger=ledger_proto(task, revision, self.ledger.now_ns()), created=created
        )

    async def Reserve(
        self, request: budget_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.ReserveResponse:
        outcome = await self._counted(
            "reserve",
            self.ledger.reserve(
                current_caller().tenant,
                request.task_id,
                request.reservation_id,
                Amounts.from_proto(request.amounts),
                request.stage,
            ),
        )
        reservation, ledger = self._outcome(outcome, request.task_id)
        return budget_pb2.ReserveResponse(
            reservation=reservation,
            ledger=ledger,
            replayed=outcome.replayed,
            attempts=outcome.attempts,
        )

    async def Settle(
        self, request: budget_pb2.SettleRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.SettleResponse:
        outcome = await self._counted(
            "settle",
            self.ledger.settle(
                current_caller().tenant,
                request.task_id,
                request.reservation_id,
                Amounts.from_proto(request.actual),
                request.failed,
            ),
        )
        reservation, ledger = self._outcome(outcome, request.task_id)
        return budget_pb2.SettleResponse(
            reservation=reservation,
            ledger=ledger,
            replayed=outcome.replayed,
            attempts=outcome.attempts,
        )

    async def Cancel(
        self, request: budget_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.CancelResponse:
        outcome = await self._counted(
            "cancel",
            self.ledger.cancel(
                current_caller().tenant, request.task_id, request.reservation_id, request.reason
            ),
        )
        reservation, ledger = self._outcome(outcome, request.task_id)
        return budget_pb2.CancelResponse(
            reservation=reservation,
            ledger=ledger,
            replayed=outcome.replayed,
            attempts=outcome.attempts,
        )

    async def GetLedger(
        self, request: budget_pb2.GetLedgerRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.Ledger:
        task, revision, reservations = await self._counted(
            "get",
            self.ledger.get(
                current_caller().tenant,
                request.task_id,
                include_reservations=request.include_reservations,
            ),
        )
        return ledger_proto(task, revision, self.ledger.now_ns(), reservations)

    async def CloseTask(
        self, request: budget_pb2.CloseTaskRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.CloseTaskResponse:
        task, revision = await self._counted(
            "close_task", self.ledger.close_task(current_caller().tenant, request.task_id)
        )
        return budget_pb2.CloseTaskResponse(
            ledger=ledger_proto(task, revision, self.ledger.now_ns())
        )

    async def Batch(
        self, request: budget_pb2.BatchRequest, context: grpc.aio.ServicerContext
    ) -> budget_pb2.BatchResponse:
        # Every item through its own handler, all at once: items of one task meet in the
        # ledger's group commit in the order sent (each enqueues before its first await).
        results = await asyncio.gather(*(self._batch_item(item, context) for item in request.items))
        return budget_pb2.BatchResponse(results=results)

    async def _batch_item(
        self, item: budget_pb2.BatchItem, context: grpc.aio.ServicerContext
    ) -> budget_pb2.BatchResult:
        kind = item.WhichOneof("operation")
        try:
            if kind == "reserve":
                return budget_pb2.BatchResult(reserve=await self.Reserve(item.reserve, context))
            if kind == "settle":
                return budget_pb2.BatchResult(settle=await self.Settle(item.settle, context))
            # the oneof is required (validated before any handler runs)
            return budget_pb2.BatchResult(cancel=await self.Cancel(item.cancel, context))
        except Exception as error:
            code, message, status = to_rpc_status(error)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("rpc.internal_error", method=f"Batch.{kind}")
            return budget_pb2.BatchResult(
                error=budget_pb2.ItemStatus(
                    code=status.code, message=message, details=status.details
                )
            )
