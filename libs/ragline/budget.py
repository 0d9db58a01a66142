"""Budget amounts and the client helper every caller of the budget service uses.

    ledger = TaskBudget(client, task_id)
    async with ledger.reserve(Amounts(output_tokens=256, calls=1), stage="generate") as r:
        reply = await call_the_model(max_tokens=256)
        r.settle(Amounts(output_tokens=reply.tokens, calls=1))

The reservation is settled on leaving the block: with the reported use on success, with
the reported use (or the whole reservation when nothing was reported) and `failed` on an
exception, and on cancellation it is first moved to pending and then settled, shielded
from further cancellation, so partial use is never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from google.protobuf.message import Message

from ragline import deadlines
from ragline.budget_batch import BATCHED_METHODS, batcher_for
from ragline.clients import ServiceClient
from ragline.errors import ResourceExhausted
from ragline.retry import DEFAULT_POLICY, RetryPolicy, call_with_retry

if TYPE_CHECKING:
    from ragline.v1 import common_pb2

log = structlog.get_logger("ragline.budget")

AMOUNT_FIELDS = ("input_tokens", "output_tokens", "cost_micros", "calls")


@dataclass(frozen=True)
class Amounts:
    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0
    calls: int = 0

    def __post_init__(self) -> None:
        for name in AMOUNT_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")

    def __add__(self, other: Amounts) -> Amounts:
        return Amounts(*(getattr(self, f) + getattr(other, f) for f in AMOUNT_FIELDS))

    def __sub__(self, other: Amounts) -> Amounts:
        """Difference, floored at zero (what remains can never be negative)."""
        return Amounts(*(max(getattr(self, f) - getattr(other, f), 0) for f in AMOUNT_FIELDS))

    def fits_within(self, limit: Amounts) -> bool:
        return all(getattr(self, f) <= getattr(limit, f) for f in AMOUNT_FIELDS)

    def exceeding(self, limit: Amounts) -> list[str]:
        """Names of the amounts above `limit`."""
        return [f for f in AMOUNT_FIELDS if getattr(self, f) > getattr(limit, f)]

    def is_zero(self) -> bool:
        return not any(getattr(self, f) for f in AMOUNT_FIELDS)

    def to_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_micros": self.cost_micros,
            "calls": self.calls,
        }

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> Amounts:
        return cls(**{f.name: int(data.get(f.name, 0)) for f in fields(cls)})

    def to_proto(self) -> common_pb2.BudgetAmounts:
        from ragline.v1 import common_pb2

        return common_pb2.BudgetAmounts(
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            cost_micros=self.cost_micros,
            calls=self.calls,
        )

    @classmethod
    def from_proto(cls, message: common_pb2.BudgetAmounts) -> Amounts:
        return cls(*(getattr(message, f) for f in AMOUNT_FIELDS))

    def describe(self) -> str:
        return ", ".join(f"{f}={getattr(self, f)}" for f in AMOUNT_FIELDS)


# Time a settlement may take after the caller's own deadline passed: settling partial use
# is bookkeeping that must happen even when the work it accounts for ran out of time.
SETTLE_TIMEOUT_S = 5.0
# A settlement that could not reach the ledger (the budget service or etcd down) is tried
# again in the background for this long, so the use it reports is not lost: until settled
# the reservation stays charged in full, and the ledger keeps a task's records for its
# deadline plus a grace period (5 minutes by default).
SETTLE_RETRY_S = 120.0
_SETTLE_RETRY_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
)
# A Reserve that failed with one of these may still have been granted.
_OUTCOME_UNKNOWN = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
)
# Settlements being retried, held so that they are not collected mid-way.
_late_settlements: set[asyncio.Task[None]] = set()


def late_settlements() -> int:
    """Settlements of this process still being retried in the background."""
    return len(_late_settlements)


class BudgetRefused(ResourceExhausted):
    """The task budget cannot cover a reservation; `remaining` says what is left."""


class Reservation:
    """An open reservation; `settle()` records actual use, applied when the block exits."""

    def __init__(self, budget: TaskBudget, reservation_id: str, amounts: Amounts, stage: str):
        self.budget = budget
        self.reservation_id = reservation_id
        self.amounts = amounts
        self.stage = stage
        self.actual: Amounts | None = None
        self.response = None  # ReserveResponse
        self.final = None  # SettleResponse

    def settle(self, actual: Amounts) -> None:
        self.actual = actual

    async def __aenter__(self) -> Reservation:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        await self.close(failed=exc_type is not None, cancelled=cancelled)

    async def open(self) -> None:
        """Reserves; BudgetRefused when the task cannot cover it."""
        from ragline.v1 import budget_pb2

        request = budget_pb2.ReserveRequest(
            task_id=self.budget.task_id,
            reservation_id=self.reservation_id,
            amounts=self.amounts.to_proto(),
            stage=self.stage,
        )
        try:
            self.response = await self.budget.call("Reserve", request)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise BudgetRefused(error.details() or "the task budget refused") from error
            if error.code() in _OUTCOME_UNKNOWN:
                # The ledger may have granted it before the answer was lost (the budget
                # service killed mid-call): release it by id in the background, without
                # holding up the caller's failure (a reservation that never landed is not
                # found, and that is the end of it).
                self._settle_in_background(Amounts(), failed=False, cancelled=False, wait=0.0)
            raise
        except asyncio.CancelledError:
            # The ledger may have granted it before the cancel arrived: release it (by id,
            # so a reservation that never landed is simply not found).
            self.actual = Amounts()  # the call it was for never ran
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.close(cancelled=True)
            raise

    async def close(self, *, failed: bool = False, cancelled: bool = False) -> None:
        """Settles the reported use (or the whole reservation when none was reported);
        a cancelled call is first moved to pending. Shielded: a second cancel must not
        abort the bookkeeping."""
        actual = self.actual if self.actual is not None else self.amounts
        task = asyncio.ensure_future(self._finish(actual, failed=failed, cancelled=cancelled))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise
        except grpc.aio.AioRpcError as error:
            if error.code() in _SETTLE_RETRY_CODES:
                self._settle_in_background(actual, failed=failed, cancelled=cancelled, wait=0.5)
            raise

    def _settle_in_background(
        self, actual: Amounts, *, failed: bool, cancelled: bool, wait: float
    ) -> None:
        task = asyncio.ensure_future(self._finish_later(actual, failed, cancelled, wait))
        _late_settlements.add(task)
        task.add_done_callback(_late_settlements.discard)

    async def _finish_later(
        self, actual: Amounts, failed: bool, cancelled: bool, wait: float
    ) -> None:
        """The settlement, with backoff, until it lands or SETTLE_RETRY_S passes (the
        caller's identity is kept: the ledger belongs to its tenant)."""
        give_up = deadlines.now() + SETTLE_RETRY_S
        while True:
            await asyncio.sleep(wait)
            try:
                await self._finish(actual, failed=failed, cancelled=cancelled)
                log.info("budget.settled_late", reservation_id=self.reservation_id)
                return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    return  # a reservation whose Reserve never landed
                if error.code() not in _SETTLE_RETRY_CODES or deadlines.now() + wait > give_up:
                    log.warning(
                        "budget.settle_lost",
                        reservation_id=self.reservation_id,
                        error=error.details(),
                        why="it stays charged in full until the task's records expire",
                    )
                    return
            wait = min(max(wait * 2, 0.5), 5.0)

    async def _finish(self, actual: Amounts, *, failed: bool, cancelled: bool) -> None:
        from ragline.v1 import budget_pb2

        task_id, reservation_id = self.budget.task_id, self.reservation_id
        with deadlines.detached(SETTLE_TIMEOUT_S):
            if cancelled:
                await self.budget.call(
                    "Cancel",
                    budget_pb2.CancelRequest(
                        task_id=task_id, reservation_id=reservation_id, reason="caller cancelled"
                    ),
                )
            self.final = await self.budget.call(
                "Settle",
                budget_pb2.SettleRequest(
                    task_id=task_id,
                    reservation_id=reservation_id,
                    actual=actual.to_proto(),
                    failed=failed,
                ),
            )


class TaskBudget:
    """Reservations against one task ledger, through a client of the budget service.

    Every call is idempotent by its reservation id, so the kit's retry rule applies: a
    lost response followed by a retry is answered as a replay, never charged twice.
    Reserve, Settle and Cancel go through the client's `BudgetCallBatcher` (`batching`,
    on by default): those the process makes at the same moment share one Batch call.
    """

    def __init__(
        self,
        client: ServiceClient,
        task_id: str,
        *,
        retry: RetryPolicy = DEFAULT_POLICY,
        batching: bool = True,
    ):
        self.client = client
        self.task_id = task_id
        self.retry = retry
        self.batcher = batcher_for(client) if batching else None

    def reserve(
        self, amounts: Amounts, *, stage: str = "", reservation_id: str | None = None
    ) -> Reservation:
        return Reservation(self, reservation_id or uuid.uuid4().hex, amounts, stage)

    async def call(self, method: str, request: Message) -> Any:  # the reply of `method`
        if self.batcher is None or method not in BATCHED_METHODS:
            return await self.client.unary(method, request, retry=self.retry)
        batcher = self.batcher
        return await call_with_retry(
            lambda: batcher.call(method, request),
            self.retry,
            what=f"{self.client.service}.{method}",
            margin_s=self.client.hop_margin_s,
        )
