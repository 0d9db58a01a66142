"""Slot scheduling: admission, queue bound, deadlines, and tenant-isolated prefix caches."""

from __future__ import annotations

import asyncio
import time

import pytest

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline_services.generation.generator import Speculation
from ragline_services.generation.scheduler import SlotScheduler


class Eraser:
    def __init__(self) -> None:
        self.erased: list[int] = []

    async def __call__(self, slot: int) -> None:
        self.erased.append(slot)


async def test_a_tenant_gets_its_own_warm_slot_back():
    eraser = Eraser()
    scheduler = SlotScheduler(2, 4, eraser)
    a = await scheduler.acquire("acme", None)
    scheduler.release(a.slot)
    b = await scheduler.acquire("globex", None)
    scheduler.release(b.slot)
    again = await scheduler.acquire("acme", None)
    assert again.slot.index == a.slot.index and again.warm and not again.erased
    assert b.slot.index != a.slot.index and not b.warm
    assert eraser.erased == []


async def test_another_tenants_slot_is_erased_before_it_is_reused():
    eraser = Eraser()
    scheduler = SlotScheduler(1, 4, eraser)
    first = await scheduler.acquire("acme", None)
    scheduler.release(first.slot)
    other = await scheduler.acquire("globex", None)
    assert other.erased and not other.warm
    assert eraser.erased == [0]
    scheduler.release(other.slot)
    back = await scheduler.acquire("acme", None)
    assert back.erased and not back.warm  # globex's cache was there: erased again


@pytest.mark.parametrize("how", ["fails", "is cancelled"])
async def test_a_slot_whose_erase_did_not_finish_is_never_handed_over_warm(how):
    class StuckEraser(Eraser):
        async def __call__(self, slot: int) -> None:
            self.erased.append(slot)
            if how == "fails":
                raise ConnectionError("engine unreachable")
            await asyncio.sleep(10)

    eraser = StuckEraser()
    scheduler = SlotScheduler(1, 4, eraser)
    first = await scheduler.acquire("acme", None)
    scheduler.release(first.slot)
    taking = asyncio.create_task(scheduler.acquire("globex", None))
    await asyncio.sleep(0.05)  # inside the erase
    if how == "is cancelled":
        taking.cancel()
    with pytest.raises((ConnectionError, asyncio.CancelledError)):
        await taking
    eraser.__class__ = Eraser  # the engine answers again
    third = await scheduler.acquire("initech", None)
    assert third.erased and not third.warm and eraser.erased == [0, 0]
    scheduler.release(third.slot)


async def test_waiters_are_served_in_order_when_slots_free():
    scheduler = SlotScheduler(1, 4, Eraser(), max_queue_per_tenant=4)
    held = await scheduler.acquire("acme", None)
    order = []

    async def wait(name):
        lease = await scheduler.acquire("acme", None)
        order.append(name)
        scheduler.release(lease.slot)

    tasks = [asyncio.create_task(wait(n)) for n in ("first", "second", "third")]
    await asyncio.sleep(0.01)
    assert scheduler.waiting == 3
    scheduler.release(held.slot)
    await asyncio.gather(*tasks)
    assert order == ["first", "second", "third"]


async def test_full_queue_is_refused_at_once_with_a_retry_hint():
    scheduler = SlotScheduler(1, 1, Eraser())
    await scheduler.acquire("acme", None)
    waiting = asyncio.create_task(scheduler.acquire("acme", None))
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted) as caught:
        await scheduler.acquire("acme", None)
    # Refused at once: the slot is still held and the queued request still waits.
    assert scheduler.busy == 1 and scheduler.waiting == 1 and not waiting.done()
    assert caught.value.retry_after_s > 0
    waiting.cancel()


async def test_deadline_while_queued_and_cancelled_waiters_leave_the_queue():
    scheduler = SlotScheduler(1, 4, Eraser())
    held = await scheduler.acquire("acme", None)
    with pytest.raises(DeadlineExceeded, match="waiting for a generation slot"):
        await scheduler.acquire("acme", time.monotonic() + 0.05)
    cancelled = asyncio.create_task(scheduler.acquire("acme", None))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert scheduler.waiting == 0
    scheduler.release(held.slot)
    lease = await asyncio.wait_for(scheduler.acquire("acme", None), 1)
    assert lease.slot.index == 0


async def test_a_flooding_tenant_neither_fills_the_queue_nor_starves_another():
    scheduler = SlotScheduler(1, 8, Eraser())  # one tenant may hold half the queue
    held = await scheduler.acquire("noisy", None)
    order = []

    async def ask(tenant, name):
        lease = await scheduler.acquire(tenant, None)
        order.append(name)
        await asyncio.sleep(0)
        scheduler.release(lease.slot)

    flood = [asyncio.create_task(ask("noisy", f"noisy-{i}")) for i in range(4)]
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="for this tenant"):
        await scheduler.acquire("noisy", None)
    quiet = asyncio.create_task(ask("quiet", "quiet"))  # room was left for it
    await asyncio.sleep(0.01)
    scheduler.release(held.slot)
    await asyncio.gather(quiet, *flood)
    assert order.index("quiet") <= 1  # behind at most one of the flood, not all four


def test_speculation_asks_for_fallback_once_below_threshold():
    speculation = Speculation("ngram", threshold=0.7, min_drafted=64)
    assert not speculation.record(30, 3)  # too little evidence yet
    assert speculation.record(40, 10)  # 13/70 accepted
    speculation.fell_back = True
    assert not speculation.record(100, 0)  # already plain: nothing more to decide
    good = Speculation("ngram", threshold=0.7)
    assert not good.record(100, 90)
    assert not Speculation("none").record(100, 0)


async def test_paused_scheduler_drains_then_hands_over_with_empty_slots():
    scheduler = SlotScheduler(1, 4, Eraser())
    running = await scheduler.acquire("acme", None)
    swapped = asyncio.Event()

    async def swap():
        async with scheduler.paused():
            swapped.set()

    swapper = asyncio.create_task(swap())
    waiter = asyncio.create_task(scheduler.acquire("acme", None))
    await asyncio.sleep(0.01)
    assert not swapped.is_set() and not waiter.done()  # the running request holds it
    scheduler.release(running.slot)
    await swapper
    lease = await asyncio.wait_for(waiter, 1)
    assert swapped.is_set() and not lease.warm  # the new engine's slot starts empty


async def test_a_request_that_would_only_wait_to_time_out_is_refused_at_once():
    scheduler = SlotScheduler(1, 8, Eraser())
    for _ in range(4):  # leases of about 0.2 s: what the wait is estimated from
        lease = await scheduler.acquire("acme", None)
        await asyncio.sleep(0.2)
        scheduler.release(lease.slot)
    held = await scheduler.acquire("acme", None)
    queued = [asyncio.create_task(scheduler.acquire("acme", None)) for _ in range(2)]
    await asyncio.sleep(0.01)
    # The running lease and one of acme's (turns go round) before it: about 0.3 s of
    # waiting, more than the 0.15 s its deadline leaves.
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as caught:
        await scheduler.acquire("globex", time.monotonic() + 0.15)
    assert time.monotonic() - started < 0.1  # refused, not left to time out
    assert caught.value.reason == "DEADLINE_TOO_SHORT_FOR_QUEUE"
    assert caught.value.retry_after_s > 0.25
    # With the time to wait, it waits its turn (one of another tenant's before it).
    patient = asyncio.create_task(scheduler.acquire("globex", time.monotonic() + 5))
    await asyncio.sleep(0.01)
    assert scheduler.waiting == 3
    scheduler.release(held.slot)
    first = await asyncio.wait_for(queued[0], 1)
    scheduler.release(first.slot)
    assert (await asyncio.wait_for(patient, 1)).slot.index == 0
    queued[1].cancel()


async def test_no_refusal_on_an_estimate_before_enough_leases_were_seen():
    scheduler = SlotScheduler(1, 8, Eraser())
    held = await scheduler.acquire("acme", None)
    with pytest.raises(DeadlineExceeded):  # waited its deadline out, as before
        await scheduler.acquire("acme", time.monotonic() + 0.05)
    scheduler.release(held.slot)


async def test_a_slot_is_warm_only_for_its_owner_within_a_tenant():
    eraser = Eraser()
    scheduler = SlotScheduler(1, 4, eraser)
    hr = await scheduler.acquire("acme", None, owner="acme|hr")
    scheduler.release(hr.slot)
    again = await scheduler.acquire("acme", None, owner="acme|hr")
    assert again.warm and not eraser.erased
    scheduler.release(again.slot)
    public = await scheduler.acquire("acme", None, owner="acme|")
    assert not public.warm and public.erased and eraser.erased == [0]
    scheduler.release(public.slot)


# -- light tenants first (priority slots) ------------------------------------------------


class Interrupts:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


async def flood_holding_both_slots(scheduler: SlotScheduler, deadline=None):
    """A flooding tenant with both ordinary slots running and one more request waiting."""
    running = [await scheduler.acquire("flood", deadline, pausable=True) for _ in range(2)]
    for lease in running:
        lease.interrupt = Interrupts()
    waiting = asyncio.create_task(scheduler.acquire("flood", deadline, pausable=True))
    await asyncio.sleep(0)
    assert not waiting.done()
    return running, waiting


async def test_a_light_tenants_request_runs_alone_and_the_flood_resumes_after_it():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    running, waiting = await flood_holding_both_slots(scheduler)
    quiet = await asyncio.wait_for(scheduler.acquire("quiet", None), 1)
    assert quiet.priority and quiet.slot.reserved  # at once, in the kept slot
    # The kept slot comes first in the engine's slots: llama-server fills each step's batch
    # in slot order, so what a paused sequence still has in the step under way goes after.
    assert quiet.slot.index == 0 and {lease.slot.index for lease in running} == {1, 2}
    assert all(lease.paused and lease.interrupt.count == 1 for lease in running)
    assert scheduler.pausing.pauses == 2
    # A flood sequence that ends meanwhile hands its slot to nobody of the flood.
    scheduler.release(running[0].slot)
    await asyncio.sleep(0)
    assert not waiting.done()
    scheduler.release(quiet.slot)
    assert not running[1].paused and await scheduler.pausing.wait_resumed(running[1], None)
    third = await asyncio.wait_for(waiting, 1)
    assert not third.paused and not third.priority


async def test_a_light_request_takes_the_kept_slot_even_beside_a_free_ordinary_one():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    flood = await scheduler.acquire("flood", None, pausable=True)
    flood.interrupt = Interrupts()
    quiet = await asyncio.wait_for(scheduler.acquire("quiet", None, light=True), 1)
    assert quiet.priority and quiet.slot.index == 0 and flood.slot.index == 1


async def test_a_tenant_alone_never_takes_the_priority_slot_nor_pauses_itself():
    scheduler = SlotScheduler(1, 8, Eraser(), priority_slots=1)
    first = await scheduler.acquire("acme", None, pausable=True)
    second = asyncio.create_task(scheduler.acquire("acme", None, pausable=True))
    await asyncio.sleep(0.01)
    assert not second.done()  # queued behind its own request, the kept slot stays free
    assert not first.paused and scheduler.pausing.pauses == 0
    scheduler.release(first.slot)
    assert not (await asyncio.wait_for(second, 1)).slot.reserved


async def test_two_tenants_with_one_request_each_share_as_before():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    acme = await scheduler.acquire("acme", None, pausable=True)
    globex = await scheduler.acquire("globex", None, pausable=True)
    assert not (acme.priority or globex.priority or acme.paused or globex.paused)
    assert not acme.slot.reserved and not globex.slot.reserved


async def test_without_priority_slots_nothing_is_paused():
    scheduler = SlotScheduler(2, 8, Eraser())
    running, waiting = await flood_holding_both_slots(scheduler)
    quiet = asyncio.create_task(scheduler.acquire("quiet", None))
    await asyncio.sleep(0.01)
    assert not quiet.done()  # it waits its turn, as before
    assert not any(lease.paused for lease in running) and scheduler.pausing.pauses == 0
    # Behind at most one request of the flood (the turns go round), as before.
    for lease in running:
        scheduler.release(lease.slot)
    assert (await asyncio.wait_for(quiet, 1)).tenant == "quiet"
    assert (await asyncio.wait_for(waiting, 1)).tenant == "flood"


async def test_a_paused_sequence_whose_deadline_passes_stops_waiting():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    running, waiting = await flood_holding_both_slots(scheduler)
    await asyncio.wait_for(scheduler.acquire("quiet", None), 1)
    started = time.monotonic()
    assert not await scheduler.pausing.wait_resumed(running[0], time.monotonic() + 0.05)
    assert time.monotonic() - started < 1.0
    waiting.cancel()


async def test_a_sequence_that_cannot_pause_runs_on():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    fixed = [await scheduler.acquire("flood", None) for _ in range(2)]
    queued = asyncio.create_task(scheduler.acquire("flood", None))
    await asyncio.sleep(0)
    quiet = await asyncio.wait_for(scheduler.acquire("quiet", None), 1)
    assert quiet.priority and not any(lease.paused for lease in fixed)
    queued.cancel()


async def test_a_request_its_caller_marks_light_pauses_the_others_whatever_they_hold():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    flood = await scheduler.acquire("flood", None, pausable=True)  # only one here
    flood.interrupt = Interrupts()
    quiet = await asyncio.wait_for(scheduler.acquire("quiet", None, light=True), 1)
    assert quiet.priority and flood.paused and flood.interrupt.count == 1
    later = asyncio.create_task(scheduler.acquire("flood", None, pausable=True))
    await asyncio.sleep(0.01)
    assert not later.done()  # nothing of another tenant starts meanwhile
    scheduler.release(quiet.slot)
    assert not flood.paused and not (await asyncio.wait_for(later, 1)).paused


async def _decoding(scheduler: SlotScheduler, tenant: str, deadline: float, decoding=True):
    lease = await scheduler.acquire(tenant, deadline, pausable=True)
    lease.interrupt = Interrupts()
    lease.decoding = decoding
    return lease


async def test_a_decoding_sequence_closer_to_its_deadline_than_a_decode_is_not_paused():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    for _ in range(4):
        scheduler.pausing.note_decode(1.0)  # decodes take about 1 s
    now = time.monotonic()
    near = await _decoding(scheduler, "flood", now + 0.5)
    far = await _decoding(scheduler, "flood", now + 30)
    quiet = await asyncio.wait_for(scheduler.acquire("quiet", None, light=True), 1)
    assert quiet.priority and far.paused and far.interrupt.count == 1
    # Paused now, it would be cut at its deadline with its answer nearly done.
    assert not near.paused and near.interrupt.count == 0
    assert scheduler.pausing.kept_for_deadline == 1


async def test_a_paused_decoding_sequence_runs_again_when_its_deadline_nears():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    for _ in range(4):
        scheduler.pausing.note_decode(0.3)
    deadline = time.monotonic() + 0.6
    decoding = await _decoding(scheduler, "flood", deadline)
    reading = await _decoding(scheduler, "flood", deadline, decoding=False)
    await asyncio.wait_for(scheduler.acquire("quiet", None, light=True), 1)
    assert decoding.paused and reading.paused  # both had more than a decode left
    started = time.monotonic()
    # The priority request still runs: the decoding one resumes 0.3 s before its deadline.
    assert await scheduler.pausing.wait_resumed(decoding, deadline)
    assert 0.2 < time.monotonic() - started < 0.5 and not decoding.paused
    # One still reading its prompt waits (it would fill the priority request's steps).
    assert not await scheduler.pausing.wait_resumed(reading, deadline)
    assert time.monotonic() >= deadline and scheduler.pausing.kept_for_deadline == 1


async def test_until_decodes_were_measured_every_sequence_pauses():
    scheduler = SlotScheduler(2, 8, Eraser(), priority_slots=1)
    near = await _decoding(scheduler, "flood", time.monotonic() + 0.2)
    await asyncio.wait_for(scheduler.acquire("quiet", None, light=True), 1)
    assert near.paused
    assert not await scheduler.pausing.wait_resumed(near, near.deadline)


async def test_paused_decoding_sequences_run_beside_a_priority_request_once_it_decodes():
    scheduler = SlotScheduler(3, 8, Eraser(), priority_slots=1)
    far = time.monotonic() + 60
    decoding = await _decoding(scheduler, "flood", far)
    reading = await _decoding(scheduler, "flood", far, decoding=False)
    quiet = await asyncio.wait_for(scheduler.acquire("quiet", None, light=True), 1)
    assert decoding.paused and reading.paused  # the light prompt has the engine alone
    scheduler.pausing.started_decoding(quiet)
    # Its prompt read, it decodes: a decoding flood sequence beside it costs little...
    assert not decoding.paused and scheduler.pausing.decoding_beside == 1
    # ...one still reading its prompt would fill its steps: it waits.
    assert reading.paused
    # A new light prompt pauses the flood again.
    other = await asyncio.wait_for(scheduler.acquire("quiet2", None, light=True), 1)
    assert decoding.paused and decoding.interrupt.count == 2
    scheduler.pausing.started_decoding(quiet)
    assert decoding.paused  # not while another priority request reads its prompt
    scheduler.pausing.started_decoding(other)
    assert not decoding.paused


async def test_a_tenant_held_back_for_a_light_one_reads_in_yielding_steps_for_a_while():
    scheduler = SlotScheduler(
        2, 4, Eraser(), priority_slots=1, yield_step_tokens=64, light_about_s=0.2
    )
    flood = await scheduler.acquire("ann", None, pausable=True)
    assert not scheduler.pausing.yielding(flood)  # nobody light yet: whole batches
    light = await scheduler.acquire("bob", None, light=True)
    assert scheduler.pausing.yielding(flood) and not scheduler.pausing.yielding(light)
    scheduler.release(light.slot)
    scheduler.release(flood.slot)
    again = await scheduler.acquire("ann", None, pausable=True)
    alone = await scheduler.acquire("carl", None, pausable=True)
    # Ann floods beside a light tenant that asks again soon; Carl was never held back.
    assert scheduler.pausing.yielding(again) and not scheduler.pausing.yielding(alone)
    await asyncio.sleep(0.3)
    assert not scheduler.pausing.yielding(again)  # the light tenant gone quiet
    scheduler.release(again.slot)
    scheduler.release(alone.slot)
    unpausable = await scheduler.acquire("ann", None)
    await scheduler.acquire("bob", None, light=True)
    assert not scheduler.pausing.yielding(unpausable)  # it could not stop between steps anyway
    off = SlotScheduler(2, 4, Eraser(), priority_slots=1)
    held = await off.acquire("ann", None, pausable=True)
    await off.acquire("bob", None, light=True)
    assert not off.pausing.yielding(held)
