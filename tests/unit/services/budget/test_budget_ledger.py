"""Ledger rules on an in-memory store (the real-etcd proof is tests/integration/test_budget.py)."""

from __future__ import annotations

import asyncio

import pytest

from ragline.budget import Amounts
from ragline.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from ragline_services.budget.ledger import TaskLedger
from ragline_services.budget.records import PENDING, SETTLED, ReservationRecord, TaskRecord


async def test_amount_arithmetic():
    a, b = Amounts(input_tokens=5, calls=1), Amounts(input_tokens=7, calls=1)
    assert a + b == Amounts(input_tokens=12, calls=2)
    assert a - b == Amounts()  # floored at zero
    assert (a + b).exceeding(Amounts(input_tokens=10, calls=5)) == ["input_tokens"]
    with pytest.raises(ValueError):
        Amounts(calls=-1)


async def test_records_round_trip():
    task = TaskRecord("t", "acme", Amounts(calls=3), 2, 10, 5, 7, used=Amounts(calls=1))
    assert TaskRecord.loads(task.dumps()) == task
    reservation = ReservationRecord(
        "r",
        Amounts(calls=1),
        "gen",
        5,
        state=SETTLED,
        actual=Amounts(calls=1),
        failed=True,
        settled_ns=9,
    )
    assert ReservationRecord.loads(reservation.dumps()) == reservation


async def test_conflicts_are_retried_and_counted(ledger):
    ledger, store, _ = ledger
    await ledger.open_task("acme", "t", Amounts(calls=5), 0, 60)
    store.lost_writes = 3
    outcome = await ledger.reserve("acme", "t", "r", Amounts(calls=1), "")
    assert outcome.attempts == 4
    assert ledger.conflicts == 3
    assert outcome.task.reserved == Amounts(calls=1)


async def test_refusal_names_what_remains(ledger):
    ledger, _, _ = ledger
    await ledger.open_task("acme", "t", Amounts(output_tokens=100, calls=2), 0, 60)
    await ledger.reserve("acme", "t", "a", Amounts(output_tokens=70, calls=1), "")
    with pytest.raises(ResourceExhausted) as caught:
        await ledger.reserve("acme", "t", "b", Amounts(output_tokens=40, calls=1), "")
    assert "output_tokens too high" in caught.value.message
    assert (
        "remaining: input_tokens=0, output_tokens=30, cost_micros=0, calls=1"
        in caught.value.message
    )


async def test_deadline_and_validation(ledger):
    ledger, _, clock = ledger
    await ledger.open_task("acme", "t", Amounts(calls=5), 0, 1.0)
    clock.ns += 2_000_000_000
    with pytest.raises(DeadlineExceeded, match="passed its deadline 1000 ms ago"):
        await ledger.reserve("acme", "t", "r", Amounts(calls=1), "")
    with pytest.raises(InvalidArgument):
        await ledger.reserve("acme", "t", "r", Amounts(), "")
    with pytest.raises(InvalidArgument):
        await ledger.reserve("acme", "t/x", "r", Amounts(calls=1), "")
    with pytest.raises(NotFound):
        await ledger.reserve("other", "t", "r", Amounts(calls=1), "")


async def test_stage_is_part_of_the_idempotency_check(ledger):
    ledger, _, _ = ledger
    await ledger.open_task("acme", "t", Amounts(calls=5), 0, 60)
    await ledger.reserve("acme", "t", "r", Amounts(calls=1), "embed")
    with pytest.raises(AlreadyExists):
        await ledger.reserve("acme", "t", "r", Amounts(calls=1), "generate")


async def test_pending_settles_from_pending_not_reserved(ledger):
    ledger, _, _ = ledger
    await ledger.open_task("acme", "t", Amounts(output_tokens=100), 0, 60)
    await ledger.reserve("acme", "t", "r", Amounts(output_tokens=50), "")
    cancelled = await ledger.cancel("acme", "t", "r", "timeout")
    assert cancelled.reservation.state == PENDING
    assert (cancelled.task.reserved, cancelled.task.pending) == (
        Amounts(),
        Amounts(output_tokens=50),
    )
    assert cancelled.task.in_flight == 0
    settled = await ledger.settle("acme", "t", "r", Amounts(output_tokens=80), failed=True)
    # above the reservation but within what the task had left (50 + 50)
    assert settled.task.used == Amounts(output_tokens=80)
    assert settled.task.pending == Amounts()


async def test_overuse_beyond_what_is_left_is_refused(ledger):
    ledger, _, _ = ledger
    await ledger.open_task("acme", "t", Amounts(output_tokens=100), 0, 60)
    await ledger.reserve("acme", "t", "r", Amounts(output_tokens=50), "")
    with pytest.raises(FailedPrecondition):
        await ledger.settle("acme", "t", "r", Amounts(output_tokens=101), failed=False)


async def test_a_stale_cache_never_decides_a_refusal(ledger):
    ledger, store, clock = ledger
    await ledger.open_task("acme", "t", Amounts(calls=2), 0, 60)
    await ledger.reserve("acme", "t", "a", Amounts(calls=1), "")
    await ledger.reserve("acme", "t", "b", Amounts(calls=1), "")
    # Another replica settles "a" behind this process's back (its cache still says 2 held).
    other = TaskLedger(store, clock_ns=clock)
    await other.settle("acme", "t", "a", Amounts(), failed=False)
    outcome = await ledger.reserve("acme", "t", "c", Amounts(calls=1), "")
    assert outcome.task.reserved == Amounts(calls=2)


async def test_replay_from_another_replica_is_detected(ledger):
    ledger, store, clock = ledger
    await ledger.open_task("acme", "t", Amounts(calls=5), 0, 60)
    other = TaskLedger(store, clock_ns=clock)
    first = await other.reserve("acme", "t", "r", Amounts(calls=1), "")
    replay = await ledger.reserve("acme", "t", "r", Amounts(calls=1), "")
    assert replay.replayed and replay.reservation == first.reservation
    assert replay.task.reserved == Amounts(calls=1)


async def test_concurrent_reserves_in_one_process_never_overspend(ledger):
    ledger, _, _ = ledger
    await ledger.open_task("acme", "t", Amounts(calls=10), 0, 60)
    results = await asyncio.gather(
        *(ledger.reserve("acme", "t", f"r{i}", Amounts(calls=1), "") for i in range(25)),
        return_exceptions=True,
    )
    granted = [r for r in results if not isinstance(r, Exception)]
    assert len(granted) == 10
    assert all(isinstance(r, ResourceExhausted) for r in results if isinstance(r, Exception))
