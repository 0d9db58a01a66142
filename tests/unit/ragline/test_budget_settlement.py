"""A settlement or a Reserve answer lost to a budget service that went away is not lost
use: it is settled again in the background until the ledger takes it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline import budget
from ragline.budget import Amounts, TaskBudget


class Unavailable(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "budget service gone")


class FlakyLedger:
    """The budget service's client: every call of `failing` methods fails while `down`."""

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.down = True
        self.calls: list[tuple[str, str]] = []

    async def unary(self, method: str, request, retry=None):
        self.calls.append((method, "down" if self.down else "up"))
        if self.down and method in self.failing:
            raise Unavailable()
        return object()


async def settled_within(timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if budget.late_settlements() == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_settlement_the_ledger_could_not_take_lands_once_it_is_back():
    ledger = FlakyLedger({"Settle"})
    reservation = TaskBudget(ledger, "t", batching=False).reserve(Amounts(calls=1))
    await reservation.open()
    reservation.settle(Amounts(calls=1))
    with pytest.raises(grpc.aio.AioRpcError):
        await reservation.close()
    assert budget.late_settlements() == 1
    ledger.down = False
    assert await settled_within()
    assert ("Settle", "up") in ledger.calls


async def test_a_reserve_whose_answer_was_lost_is_released_by_id():
    ledger = FlakyLedger({"Reserve", "Settle"})
    reservation = TaskBudget(ledger, "t", batching=False).reserve(Amounts(calls=1))
    with pytest.raises(grpc.aio.AioRpcError):
        await reservation.open()  # it may have been granted before the answer was lost
    ledger.down = False
    assert await settled_within()
    assert ledger.calls[-1] == ("Settle", "up")


async def test_a_refused_reserve_is_not_released():
    class Refusing(FlakyLedger):
        async def unary(self, method, request, retry=None):
            self.calls.append((method, "up"))
            raise Unavailable(grpc.StatusCode.FAILED_PRECONDITION)

    ledger = Refusing(set())
    with pytest.raises(grpc.aio.AioRpcError):
        await TaskBudget(ledger, "t", batching=False).reserve(Amounts(calls=1)).open()
    await asyncio.sleep(0.1)
    assert budget.late_settlements() == 0 and ledger.calls == [("Reserve", "up")]
