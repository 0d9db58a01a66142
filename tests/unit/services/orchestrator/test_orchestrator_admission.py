from __future__ import annotations

import asyncio
import time

import pytest

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline_services.orchestrator.admission import Admission


async def hold(admission: Admission, release: asyncio.Event, deadline=None, log=None, name=""):
    async with admission.admit(deadline):
        if log is not None:
            log.append(name)
        await release.wait()


async def test_runs_beyond_the_limit_queue_then_are_refused_at_once():
    admission = Admission(max_in_flight=1, max_queue=1)
    release = asyncio.Event()
    log: list[str] = []
    first = asyncio.create_task(hold(admission, release, log=log, name="first"))
    await asyncio.sleep(0.01)
    queued = asyncio.create_task(hold(admission, release, log=log, name="queued"))
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted) as caught:
        async with admission.admit(None):
            pass
    assert caught.value.retry_after_s > 0
    assert admission.in_flight == 1 and admission.waiting == 1  # refused while both wait
    release.set()
    await asyncio.gather(first, queued)
    assert log == ["first", "queued"] and admission.in_flight == 0


async def test_a_queued_run_whose_deadline_passes_leaves_before_any_work():
    # Runs look quick, so it queues; then the first one holds on past its deadline.
    admission = Admission(max_in_flight=1, max_queue=4, typical_run_s=0.001)
    release = asyncio.Event()
    first = asyncio.create_task(hold(admission, release))
    await asyncio.sleep(0.01)
    log: list[str] = []
    with pytest.raises(DeadlineExceeded, match="queued for admission"):
        await hold(admission, release, deadline=time.monotonic() + 0.05, log=log, name="late")
    assert log == [] and admission.waiting == 0
    release.set()
    await first
    assert admission.in_flight == 0


async def test_a_cancelled_waiter_gives_its_place_back():
    admission = Admission(max_in_flight=1, max_queue=4)
    release = asyncio.Event()
    first = asyncio.create_task(hold(admission, release))
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(hold(admission, release))
    await asyncio.sleep(0.01)
    waiter.cancel()
    release.set()
    await first
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.in_flight == 0 and admission.waiting == 0


async def test_a_run_that_could_only_time_out_in_the_queue_is_refused_at_once():
    admission = Admission(max_in_flight=1, max_queue=8, typical_run_s=2.0)
    release = asyncio.Event()
    first = asyncio.create_task(hold(admission, release))
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="would wait about"):
        async with admission.admit(time.monotonic() + 1.0):  # 2 s queued + 2 s run > 1 s
            pass
    assert admission.waiting == 0
    release.set()
    await first
