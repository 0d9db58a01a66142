from __future__ import annotations

import asyncio
import time

import pytest

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline_services.orchestrator.admission import Admission, _Waiter


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


async def test_a_freed_place_goes_to_the_quiet_tenant_not_the_floods_backlog():
    admission = Admission(max_in_flight=2, max_queue=16)
    release = {name: asyncio.Event() for name in ("f1", "f2", "f3", "f4", "f5", "q")}
    log: list[str] = []

    def start(tenant, name):
        async def run():
            async with admission.admit(None, tenant):
                log.append(name)
                await release[name].wait()

        return asyncio.create_task(run())

    tasks = [start("flood", name) for name in ("f1", "f2", "f3", "f4", "f5")]
    await asyncio.sleep(0.01)
    tasks.append(start("quiet", "q"))
    await asyncio.sleep(0.01)
    assert log == ["f1", "f2"] and admission.waiting == 4
    release["f1"].set()
    await asyncio.sleep(0.01)
    assert log[-1] == "q"  # ahead of the flood's three queued runs
    for event in release.values():
        event.set()
    await asyncio.gather(*tasks)
    assert log == ["f1", "f2", "q", "f3", "f4", "f5"] and admission.in_flight == 0


async def test_one_tenant_cannot_fill_the_queue_for_everyone():
    admission = Admission(max_in_flight=1, max_queue=4)  # 2 queued per tenant at most
    release = asyncio.Event()
    first = asyncio.create_task(hold(admission, release))
    await asyncio.sleep(0.01)
    queued = [asyncio.create_task(hold(admission, release)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(ResourceExhausted) as caught:
        async with admission.admit(None):
            pass
    assert caught.value.metadata["scope"] == "tenant"
    other = asyncio.create_task(_admit_as(admission, "other", release))
    await asyncio.sleep(0.01)
    assert admission.waiting == 3  # another tenant still queues
    release.set()
    await asyncio.gather(first, *queued, other)


async def _admit_as(admission: Admission, tenant: str, release: asyncio.Event) -> None:
    async with admission.admit(None, tenant):
        await release.wait()


async def test_a_run_that_must_queue_and_could_not_finish_is_refused_at_once():
    admission = Admission(max_in_flight=1, max_queue=8, typical_run_s=0.2)
    for seconds in [0.2] * 8 + [2.0] * 2:  # most runs are quick, the slow tenth take 2 s
        admission.times._everyone.append(seconds)
    release = asyncio.Event()
    first = asyncio.create_task(hold(admission, release))
    await asyncio.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as caught:
        async with admission.admit(time.monotonic() + 1.0):
            pass
    assert time.monotonic() - started < 0.1  # at once, not at its deadline
    assert caught.value.reason == "DEADLINE_TOO_SHORT_FOR_QUEUE" and caught.value.retry_after_s
    # With room for a slow run after its wait it queues.
    waiting = asyncio.create_task(hold(admission, release, deadline=time.monotonic() + 10))
    await asyncio.sleep(0.01)
    assert admission.waiting == 1
    release.set()
    await asyncio.gather(first, waiting)


async def test_a_flood_leaves_an_active_quiet_tenant_its_share_free():
    admission = Admission(max_in_flight=2, max_queue=16, activity_s=0.3)
    release = asyncio.Event()
    async with admission.admit(None, "quiet"):
        pass  # the quiet tenant asked a moment ago: it is active
    floods = [asyncio.create_task(_admit_as(admission, "flood", release)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert admission.in_flight == 1 and admission.waiting == 2  # its share: one place
    started = time.monotonic()
    async with admission.admit(None, "quiet"):  # the kept place: no wait
        assert time.monotonic() - started < 0.05
    # Once the quiet tenant has been quiet for activity_s, the flood may use every place.
    await asyncio.sleep(1.2)
    assert admission.in_flight == 2 and admission.waiting == 1
    release.set()
    await asyncio.gather(*floods)
    assert admission.in_flight == 0
    # A tenant alone uses every place at once.
    alone = Admission(max_in_flight=2, max_queue=4)
    gate = asyncio.Event()
    both = [asyncio.create_task(_admit_as(alone, "only", gate)) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert alone.in_flight == 2
    gate.set()
    await asyncio.gather(*both)


async def test_a_tenant_asking_alone_beside_a_flood_is_the_light_one():
    admission = Admission(max_in_flight=4, max_queue=8)
    release = asyncio.Event()

    async def flood_run():
        async with admission.admit(None, "flood"):
            await release.wait()

    async with admission.admit(None, "quiet"):
        assert not admission.light("quiet")  # nobody floods yet
        flood = [asyncio.create_task(flood_run()) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert admission.light("quiet")
        assert not admission.light("flood")
    async with admission.admit(None, "quiet"), admission.admit(None, "quiet"):
        assert not admission.light("quiet")  # two of its own in flight: not light
    release.set()
    await asyncio.gather(*flood)


async def _runs_of(admission: Admission, tenant: str, ran_out: list[bool]) -> None:
    """Records finished runs of `tenant`, each marked as its deadline left it."""
    for cut in ran_out:
        async with admission.admit(None, tenant) as place:
            place.ran_out = cut


async def test_a_tenant_whose_runs_mostly_ran_out_is_refused_at_once_while_one_runs():
    admission = Admission(max_in_flight=4, max_queue=8)
    await _runs_of(admission, "flood", [True, True, True, False])
    await _runs_of(admission, "quiet", [False] * 4)
    release = asyncio.Event()
    # Alone, it still runs: that run keeps measuring what its runs take.
    probe = asyncio.create_task(hold(admission, release, deadline=time.monotonic() + 10))
    probe_tenant = asyncio.create_task(
        _admit_as_until(admission, "flood", release, time.monotonic() + 10)
    )
    await asyncio.sleep(0.01)
    assert admission.in_flight == 2
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="ran out of time") as caught:
        async with admission.admit(time.monotonic() + 10, "flood"):
            pass
    assert time.monotonic() - started < 0.1 and caught.value.retry_after_s > 0
    assert caught.value.reason == "DEADLINE_TOO_SHORT_FOR_QUEUE"
    # Places are free: another tenant, and a run without a deadline, are admitted.
    async with admission.admit(time.monotonic() + 10, "quiet"):
        pass
    async with admission.admit(None, "flood"):
        pass
    release.set()
    await asyncio.gather(probe, probe_tenant)


async def test_a_run_that_ends_in_deadline_exceeded_counts_as_one_that_ran_out():
    admission = Admission(max_in_flight=4, max_queue=8)
    for _ in range(3):
        with pytest.raises(DeadlineExceeded):
            async with admission.admit(None, "flood"):
                raise DeadlineExceeded("cut")
    await _runs_of(admission, "flood", [False])
    assert admission.times.ran_out_mostly("flood") and not admission.times.ran_out_mostly("quiet")
    # As its runs fit again, the estimate follows.
    await _runs_of(admission, "flood", [False] * 4)
    assert not admission.times.ran_out_mostly("flood")


async def test_a_queued_run_is_judged_by_its_own_tenants_run_times():
    admission = Admission(max_in_flight=2, max_queue=8, typical_run_s=0.5)
    await _runs_of(admission, "slow", [False] * 4)
    for run in admission.times.tenants["slow"].runs:
        run.held_s = 6.0  # its runs take 6 s; everyone's (0.5 s) would let it queue
    release = asyncio.Event()
    running = [
        asyncio.create_task(_admit_as_until(admission, "slow", release, None)) for _ in range(2)
    ]
    await asyncio.sleep(0.01)
    # Its two places free in about 6 s / 2, then a run of up to 6 s: more than 8 s.
    with pytest.raises(ResourceExhausted, match=r"would wait about 3\.0 s"):
        async with admission.admit(time.monotonic() + 8, "slow"):
            pass
    # A tenant with no runs of its own measured queues on everyone's figures.
    other = asyncio.create_task(_admit_as_until(admission, "other", release, time.monotonic() + 10))
    await asyncio.sleep(0.01)
    assert admission.waiting == 1
    release.set()
    await asyncio.gather(*running, other)


async def _admit_as_until(
    admission: Admission, tenant: str, release: asyncio.Event, deadline: float | None
) -> None:
    async with admission.admit(deadline, tenant):
        await release.wait()


async def test_a_tenant_beside_one_that_asks_far_more_often_is_the_light_one():
    """The front door may hold a flood to one run in flight (its others refused): the
    tenant asking at least twice as often is still the heavier one."""
    admission = Admission(max_in_flight=4, max_queue=8)
    release = asyncio.Event()
    await _runs_of(admission, "flood", [False] * 5)  # five asks just now
    flood = asyncio.create_task(_admit_as_until(admission, "flood", release, None))
    await asyncio.sleep(0.01)
    async with admission.admit(None, "quiet"):
        assert admission.light("quiet") and not admission.light("flood")
        release.set()
        await flood
        # With nothing of the flood in flight this moment: still the light one (the
        # flood's next run may be admitted while it generates).
        assert admission.in_flight == 1 and admission.light("quiet")
    # A tenant asking as often as the other (both with one run in flight) is not light.
    await _runs_of(admission, "steady", [False] * 5)
    async with admission.admit(None, "steady"):
        assert not admission.light("steady")


async def test_a_tenant_beside_one_the_front_door_refuses_is_the_light_one():
    """A quiet tenant asking back to back can ask half as often as a flood, now and then
    more: the flood's refusals, not its rate alone, make the quiet tenant the light one."""
    admission = Admission(max_in_flight=2, max_queue=8)
    await _runs_of(admission, "flood", [False] * 4)
    await _runs_of(admission, "quiet", [False] * 4)
    for tenant in ("flood", "quiet"):
        for run in admission.times.tenants[tenant].runs:
            run.held_s = 6.0
    release = asyncio.Event()
    flood = asyncio.create_task(_admit_as_until(admission, "flood", release, None))
    await asyncio.sleep(0.01)
    async with admission.admit(None, "quiet"):
        # Asking about as often, neither has more than one run: nobody is light yet.
        assert not admission.light("quiet")
        # Its share held, a flood run that cannot wait 6 s is refused.
        with pytest.raises(ResourceExhausted):
            async with admission.admit(time.monotonic() + 1, "flood"):
                pass
        assert admission.light("quiet") and not admission.light("flood")
        # A tenant refused lately is not light itself.
        with pytest.raises(ResourceExhausted):
            async with admission.admit(time.monotonic() + 1, "quiet"):
                pass
        assert not admission.light("quiet")
    release.set()
    await flood


async def test_a_run_handed_a_place_too_late_to_finish_is_refused_and_the_place_goes_on():
    admission = Admission(max_in_flight=1, max_queue=8)
    await _runs_of(admission, "slow", [False] * 4)
    for run in admission.times.tenants["slow"].runs:
        run.held_s = 2.0
    release = asyncio.Event()
    running = asyncio.create_task(_admit_as_until(admission, "slow", release, None))
    await asyncio.sleep(0.01)
    # Queued with room for its wait and a run as measured then (2 s + 2 s).
    late = asyncio.create_task(_admit_as_until(admission, "slow", release, time.monotonic() + 5))
    other = asyncio.create_task(_admit_as_until(admission, "other", release, None))
    await asyncio.sleep(0.01)
    assert admission.waiting == 2
    # What ran meanwhile took far longer: its runs now take 8 s, more than it has left.
    for run in admission.times.tenants["slow"].runs:
        run.held_s = 8.0
    release.set()
    with pytest.raises(ResourceExhausted, match=r"waited 0\.\d s for a place") as caught:
        await late
    assert caught.value.reason == "DEADLINE_TOO_SHORT_FOR_QUEUE" and caught.value.retry_after_s
    await asyncio.gather(running, other)  # the place went on to the next waiter
    assert admission.in_flight == 0 and admission.waiting == 0


async def test_a_waiter_refused_as_its_deadline_passes_gives_back_no_place():
    """A refusal at hand-over took no place: when the waiter's own timeout fires in the
    same turn (before the refusal reaches it), giving up must not free a place."""
    admission = Admission(max_in_flight=1, max_queue=8)
    release = asyncio.Event()
    holder = asyncio.create_task(_admit_as_until(admission, "other", release, None))
    await asyncio.sleep(0.01)
    waiter = _Waiter("slow", time.monotonic() + 1, asyncio.get_running_loop().create_future())
    waiter.future.set_exception(ResourceExhausted("refused at hand-over"))
    admission._abandon(waiter)  # what its wait does on TimeoutError
    assert admission.in_flight == 1  # the holder's place, and only it
    release.set()
    await holder
    assert admission.in_flight == 0


async def test_a_tenant_asking_for_more_than_it_gets_tells_the_orchestrator_each_time():
    """What may turn another tenant's run light (`light`) is reported as it happens: a
    tenant's second run admitted, a run queued, a run refused. A tenant's lone run is not."""
    admission = Admission(max_in_flight=2, max_queue=1)
    pressed: list[tuple[int, int]] = []
    admission.on_pressure = lambda: pressed.append((admission.in_flight, admission.waiting))
    release = asyncio.Event()
    first = asyncio.create_task(_admit_as_until(admission, "flood", release, None))
    await asyncio.sleep(0.01)
    assert pressed == []  # one run alone: nobody asks for more than it gets
    second = asyncio.create_task(_admit_as_until(admission, "flood", release, None))
    await asyncio.sleep(0.01)
    assert pressed == [(2, 0)]  # its second run in flight
    queued = asyncio.create_task(_admit_as_until(admission, "flood", release, None))
    await asyncio.sleep(0.01)
    assert pressed[-1] == (2, 1)  # a run waiting
    with pytest.raises(ResourceExhausted):
        async with admission.admit(None, "flood"):
            pass
    assert len(pressed) == 3  # refused: the queue is full
    release.set()
    await asyncio.gather(first, second, queued)


async def _queue_as(admission: Admission, tenant: str, deadline: float) -> None:
    async with admission.admit(deadline, tenant):
        pass


async def test_a_tenant_measured_alone_queues_beside_another_only_once_measured_there():
    admission = Admission(max_in_flight=2, max_queue=8, typical_run_s=0.5)
    await _runs_of(admission, "flood", [False] * 4)  # quick, and alone
    release = asyncio.Event()
    held = [
        asyncio.create_task(_admit_as_until(admission, tenant, release, None))
        for tenant in ("quiet", "flood")  # a tenant beside it: its share is one place
    ]
    await asyncio.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="ran alone") as caught:
        # Its runs alone would let it queue (a wait and a slow run of well under 10 s).
        await asyncio.wait_for(_queue_as(admission, "flood", time.monotonic() + 10), 1.0)
    assert time.monotonic() - started < 0.1 and caught.value.retry_after_s > 0
    assert caught.value.reason == "DEADLINE_TOO_SHORT_FOR_QUEUE"
    release.set()
    await asyncio.gather(*held)
    # Measured beside the quiet tenant (still active), it queues on those runs.
    await _runs_of(admission, "flood", [False] * 4)
    release = asyncio.Event()
    held = [
        asyncio.create_task(_admit_as_until(admission, tenant, release, None))
        for tenant in ("quiet", "flood")
    ]
    await asyncio.sleep(0.01)
    queued = asyncio.create_task(_queue_as(admission, "flood", time.monotonic() + 10))
    await asyncio.sleep(0.01)
    assert admission.waiting == 1
    release.set()
    await asyncio.gather(*held, queued)
