from __future__ import annotations

import asyncio
import time

import pytest

from ragline import deadlines
from ragline.errors import DeadlineExceeded


def test_unbounded_by_default():
    assert deadlines.remaining() is None
    assert deadlines.outbound_timeout("x") is None
    deadlines.check("x")  # no deadline, nothing to refuse


def test_scope_narrows_and_never_widens():
    with deadlines.deadline_scope(1.0) as outer:
        assert 0.9 < deadlines.remaining() <= 1.0
        with deadlines.deadline_scope(10.0) as inner:
            assert inner == outer  # a child cannot get more time than its parent
        with deadlines.deadline_scope(0.1):
            assert deadlines.remaining() <= 0.1
        assert deadlines.current_deadline() == outer
    assert deadlines.current_deadline() is None


def test_outbound_timeout_keeps_the_margin_and_the_stage_budget():
    with deadlines.deadline_scope(2.0):
        timeout = deadlines.outbound_timeout("svc.Call", margin_s=0.05)
        assert timeout <= 2.0 - 0.05
        assert deadlines.outbound_timeout("svc.Call", margin_s=0.05, stage_budget_s=0.5) == 0.5
    assert deadlines.outbound_timeout("svc.Call", stage_budget_s=0.5) == 0.5


def test_expired_deadline_refuses_without_calling():
    with deadlines.deadline_scope(0.01):
        time.sleep(0.02)
        assert deadlines.expired()
        with pytest.raises(DeadlineExceeded, match=r"no time left to call svc\.Call"):
            deadlines.outbound_timeout("svc.Call")
        with pytest.raises(DeadlineExceeded):
            deadlines.check("work")


def test_margin_larger_than_what_remains_refuses():
    with deadlines.deadline_scope(0.004), pytest.raises(DeadlineExceeded):
        deadlines.outbound_timeout("svc.Call", margin_s=0.005)


def test_deadline_from_grpc():
    before = time.monotonic()
    assert deadlines.deadline_from_grpc(None, 0) is None
    assert deadlines.deadline_from_grpc(None, 30) >= before + 30
    assert before + 1.9 < deadlines.deadline_from_grpc(2.0, 30) <= time.monotonic() + 2.0
    # the exact header wins over gRPC's rounded-up value, but never widens it
    assert deadlines.deadline_from_grpc(1.0, 30, "975000") <= time.monotonic() + 0.975
    assert deadlines.deadline_from_grpc(1.0, 30, "5000000") <= time.monotonic() + 1.0
    assert deadlines.deadline_from_grpc(None, 30, "250000") <= time.monotonic() + 0.25
    assert deadlines.deadline_from_grpc(1.0, 30, "garbage") <= time.monotonic() + 1.0


async def test_deadline_is_per_task():
    async def child(seconds: float) -> float:
        with deadlines.deadline_scope(seconds):
            await asyncio.sleep(0)
            return deadlines.remaining()

    a, b = await asyncio.gather(child(1.0), child(5.0))
    assert a <= 1.0 < b
    assert deadlines.current_deadline() is None


def test_deadline_works_with_asyncio_timeout_at():
    async def run():
        with deadlines.deadline_scope(0.05):
            async with asyncio.timeout_at(deadlines.current_deadline()):
                await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        asyncio.run(run())


async def _ticks(interval_s: float, count: int = 1000):
    for index in range(count):
        await asyncio.sleep(interval_s)
        yield index


async def test_stream_deadline_interrupts_a_read_in_progress():
    loop = asyncio.get_running_loop()
    started = loop.time()
    with deadlines.StreamDeadline(started + 0.05) as timer:
        with pytest.raises(TimeoutError):
            await timer.read(_ticks(10.0))
    assert loop.time() - started < 1.0
    assert asyncio.current_task().cancelling() == 0  # no cancellation left behind


async def test_stream_deadline_never_cancels_the_readers_own_code():
    loop = asyncio.get_running_loop()
    stream = _ticks(0.001)
    with deadlines.StreamDeadline(loop.time() + 0.05) as timer:
        assert await timer.read(stream) == 0
        await asyncio.sleep(0.1)  # the reader's own work outlives the deadline, untouched
        assert timer.expired
        with pytest.raises(TimeoutError):
            await timer.read(stream)  # and the next read refuses at once


async def test_stream_deadline_reads_every_item_in_time_and_disarms():
    loop = asyncio.get_running_loop()
    with deadlines.StreamDeadline(loop.time() + 0.2) as timer:
        stream = _ticks(0.001, 5)
        items = []
        with pytest.raises(StopAsyncIteration):
            while True:
                items.append(await timer.read(stream))
    assert items == [0, 1, 2, 3, 4]
    await asyncio.sleep(0.3)  # left the block: the timer never fires afterwards
    assert not timer.expired


async def test_stream_deadline_leaves_another_cancellation_a_cancellation():
    async def reader():
        with deadlines.StreamDeadline(None) as timer:
            await timer.read(_ticks(10.0))

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_stream_deadline_and_a_caller_cancel_together_stay_cancelled():
    loop = asyncio.get_running_loop()
    # One instant for both (a busy machine cannot pull them apart): they land in the
    # same tick, in either order.
    at = loop.time() + 0.05

    async def reader():
        with deadlines.StreamDeadline(at) as timer:
            await timer.read(_ticks(10.0))

    task = asyncio.create_task(reader())
    loop.call_at(at, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_interrupt_ends_the_read_in_progress_and_the_stream_reads_on():
    loop = asyncio.get_running_loop()
    stream = _ticks(0.2, 3)
    with deadlines.StreamDeadline(None) as timer:
        loop.call_later(0.02, timer.interrupt)
        started = loop.time()
        with pytest.raises(deadlines.StreamInterrupted):
            await timer.read(stream)
        assert loop.time() - started < 0.15  # at once, not at the next item
        assert asyncio.current_task().cancelling() == 0
        fresh = _ticks(0.001, 2)  # a reader asked to stop opens its stream again
        assert [await timer.read(fresh), await timer.read(fresh)] == [0, 1]


async def test_an_interrupt_between_reads_ends_the_next_one_once():
    stream = _ticks(0.001, 3)
    with deadlines.StreamDeadline(None) as timer:
        assert await timer.read(stream) == 0
        timer.interrupt()  # while the reader's own code runs
        with pytest.raises(deadlines.StreamInterrupted):
            await timer.read(stream)
        assert await timer.read(stream) == 1


async def test_an_interrupt_never_hides_the_deadline_or_a_caller_cancel():
    loop = asyncio.get_running_loop()
    with deadlines.StreamDeadline(loop.time() + 0.02) as timer:
        await asyncio.sleep(0.05)
        timer.interrupt()
        with pytest.raises(TimeoutError):
            await timer.read(_ticks(10.0))

    async def reader():
        with deadlines.StreamDeadline(None) as timer:
            loop.call_later(0.01, timer.interrupt)
            with pytest.raises(deadlines.StreamInterrupted):
                await timer.read(_ticks(10.0))
            await timer.read(_ticks(10.0))

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
