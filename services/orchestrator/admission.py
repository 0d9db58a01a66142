"""Admission of runs: a bounded number in flight, then bounded queues (one per tenant) whose
entries carry their deadline, then an immediate RESOURCE_EXHAUSTED with a retry delay. No
gRPC here.

Goodput before throughput: a run that could only time out is refused at once, while a
retry elsewhere (or later) can still help: when what is ahead of it in the queue plus a
run's slow case (the 90th percentile of recent run times) does not fit its deadline. What is
admitted can finish; nothing is let in only to be cut at its deadline.

Run times are measured per tenant as well as for everyone: a tenant's runs can take far
longer than the others' (a flood whose generations pause for a light tenant's, a tenant
whose questions need the large model), and a run its deadline cut counts as one that did
not fit (it needed more than it had). A tenant's run with a place free is still refused
when most of its recent runs ran out of time and another of its runs is under way (that
one keeps measuring, so the estimate follows when things get faster); one that must queue
is refused when its wait and its tenant's slow case do not fit.

Fairness between tenants: each tenant queues apart (at most `max_queue_per_tenant`, so a
flood cannot fill the queue for everyone), and a freed place goes to the waiting tenant with
the fewest runs in flight (round robin among equals). While several tenants are active
(asked within the last `activity_s`), each may hold at most its share of the places
(max_in_flight / active tenants, at least one): a flooding tenant then leaves a quiet one's
share free for its next question instead of taking every place that frees. A tenant alone
uses every place.

A queued run whose deadline passes leaves the queue with DEADLINE_EXCEEDED before any work;
a cancelled one just leaves. One handed a place with less time left than a slow run of its
tenant (what was ahead of it ran longer than expected: the test it passed to queue no
longer holds) is refused then, and the place goes on to the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline.fair_queue import FairQueue

# Recent runs whose durations set the expected and the slow run time.
_WINDOW = 64
# A tenant's recent runs, and how many make its own estimate (fewer: everyone's).
_TENANT_WINDOW = 16
_TENANT_SAMPLES = 4
# The half-life of a tenant's ask rate (asks refused included), and how many times another
# tenant's rate makes it the heavier one.
_RATE_HALF_LIFE_S = 10.0
_HEAVIER = 2.0
# Tenants remembered (when they last asked, their run times) before idle ones are forgotten.
_TENANTS_KEPT = 4096
_FORGET_AFTER_S = 600.0


@dataclass
class Place:
    """A run's place while it runs: when it was admitted, and whether its deadline cut it
    (the caller says so; a run that ends in DeadlineExceeded is one)."""

    admitted: float
    ran_out: bool = False


@dataclass
class _Run:
    held_s: float
    ran_out: bool
    # Another tenant was active as it began or ended: a tenant's runs take longer beside
    # others (its generations pause for light ones, the cores are shared).
    beside: bool = False

    @property
    def needed_s(self) -> float:
        """What the run needed: its time, or more than any deadline where it ran out."""
        return math.inf if self.ran_out else self.held_s


@dataclass
class _Tenant:
    """What admission remembers of a tenant: when it last asked, its asks (admitted or
    refused) each counted less as it ages (halved every _RATE_HALF_LIFE_S), its recent
    runs, and when it was last refused."""

    last_asked: float
    asks: float = 0.0
    runs: deque[_Run] = field(default_factory=lambda: deque(maxlen=_TENANT_WINDOW))
    last_refused: float = -math.inf  # when the front door last refused it

    def rate(self, now: float) -> float:
        """Proportional to its recent ask rate."""
        return self.asks * 0.5 ** ((now - self.last_asked) / _RATE_HALF_LIFE_S)

    def asked(self, now: float) -> None:
        self.asks = self.rate(now) + 1.0
        self.last_asked = now


@dataclass
class _Waiter:
    tenant: str
    deadline: float | None
    future: asyncio.Future = field(repr=False)
    queued: float = field(default_factory=time.monotonic)


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        max_queue: int,
        *,
        max_queue_per_tenant: int = 0,
        typical_run_s: float = 2.0,
        activity_s: float = 5.0,
    ) -> None:
        self.max_in_flight = max_in_flight
        # Waiters by tenant; among tenants with as many runs, the round's order.
        self._queue: FairQueue[str, _Waiter] = FairQueue(max_queue, max_queue_per_tenant)
        self.activity_s = activity_s
        self.in_flight = 0
        self._running: Counter[str] = Counter()  # runs in flight per tenant
        self._runs: deque[float] = deque([typical_run_s], maxlen=_WINDOW)
        self._tenants: dict[str, _Tenant] = {}
        self._recheck: asyncio.TimerHandle | None = None
        # Called when a tenant asks for more than it gets (a run refused, queued, or a
        # second one admitted): a run of another tenant may have turned light (`light`).
        self.on_pressure: Callable[[], None] | None = None

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    def _own_runs(self, tenant: str | None) -> Sequence[_Run] | None:
        """`tenant`'s recent runs when there are enough to go by: those that ran as it
        would now (beside other active tenants, or alone) where there are enough."""
        known = None if tenant is None else self._tenants.get(tenant)
        if tenant is None or known is None or len(known.runs) < _TENANT_SAMPLES:
            return None
        beside = self._beside_others(tenant)
        alike = [run for run in known.runs if run.beside == beside]
        return alike if len(alike) >= _TENANT_SAMPLES else known.runs

    def _measured_alone_only(self, tenant: str) -> bool:
        """Whether other tenants are active now while `tenant`'s runs were measured alone
        (fewer than enough of them beside others): its figures say too little."""
        known = self._tenants.get(tenant)
        if known is None or not known.runs or not self._beside_others(tenant):
            return False
        return sum(run.beside for run in known.runs) < _TENANT_SAMPLES

    def _held_s(self, tenant: str | None) -> Sequence[float]:
        """Recent run times: `tenant`'s own where there are enough, else everyone's."""
        own = self._own_runs(tenant)
        return self._runs if own is None else [r.held_s for r in own]

    def typical_run_s(self, tenant: str | None = None) -> float:
        """The median of recent run times (`tenant`'s own where there are enough)."""
        return float(np.median(self._held_s(tenant)))

    def mean_run_s(self, tenant: str | None = None) -> float:
        """The mean of recent run times (`tenant`'s own where there are enough): k runs
        ahead take about k of it in all (the median undercounts when quick abstentions sit
        beside slow answers)."""
        return float(np.mean(self._held_s(tenant)))

    def slow_run_s(self, tenant: str | None = None) -> float:
        """The 90th percentile of recent run times, `tenant`'s own where there are enough
        (infinite when more than a tenth of them ran out of time): what a run admitted now
        must be ready to take."""
        own = self._own_runs(tenant)
        if own is None:
            return float(np.percentile(self._runs, 90))
        return float(np.percentile([r.needed_s for r in own], 90, method="higher"))

    def ran_out_mostly(self, tenant: str) -> bool:
        """Whether most of `tenant`'s recent runs ran out of time."""
        own = self._own_runs(tenant)
        return own is not None and 2 * sum(r.ran_out for r in own) > len(own)

    def retry_after_s(self, tenant: str | None = None) -> float:
        ahead = self.in_flight + self.waiting + 1 - self.max_in_flight
        everyone = self.typical_run_s() * ahead / max(self.max_in_flight, 1)
        if tenant is None or self._own_runs(tenant) is None:
            return max(everyone, 0.05)
        # Its own place frees when one of its runs ends.
        own = self.typical_run_s(tenant) / max(self._running[tenant], 1)
        return max(everyone, own, 0.05)

    def expected_wait_s(self, tenant: str = "") -> float:
        """How long a run of `tenant` queued now would wait: nothing while a place within
        its share is free; else its queued runs and this one drain through the places it
        may hold (its share; one of all of them when the share is not what blocks it),
        one mean run each."""
        share = self.share(tenant)
        if self.in_flight < self.max_in_flight and self._running[tenant] < share:
            return 0.0
        ahead = self._queue.waiting_of(tenant) + 1
        if self._running[tenant] >= share:  # its own runs must end first
            return self.mean_run_s(tenant) * ahead / share
        return self.mean_run_s() * ahead / self.max_in_flight

    def share(self, tenant: str, now: float | None = None) -> int:
        """The places `tenant` may hold now: all of them while it is the only active tenant,
        else its equal share (at least one)."""
        return max(1, self.max_in_flight // len(self._active(tenant, now)))

    def _active(self, tenant: str, now: float | None = None) -> set[str]:
        """The tenants active now (asked within activity_s, running or waiting), `tenant`
        among them."""
        now = time.monotonic() if now is None else now
        active = {t for t, k in self._tenants.items() if now - k.last_asked < self.activity_s}
        return active | set(self._running) | set(self._queue.keys()) | {tenant}

    def _beside_others(self, tenant: str, now: float | None = None) -> bool:
        return len(self._active(tenant, now)) > 1

    def light(self, tenant: str) -> bool:
        """Whether `tenant`, with one run in flight, is a light tenant beside a flood now:
        no other run of its own in flight or waiting and none refused lately, while
        another tenant asks for more than it gets: two or more runs in flight or waiting,
        a refusal within activity_s (the front door may hold a flood to one run in flight
        or none, and the next may be admitted while this one generates), or it is active
        and asks at least twice as often. Its generation goes first
        (GenerateRequest.light_tenant), and the heavier tenants' generations wait for it:
        a tenant within its share before those beyond theirs, as fair queueing serves a
        sparse flow before a backlogged one. (Ask rates alone misjudged a quiet tenant
        asking back to back: half a flood's rate, now and then more.) A run may turn light
        while it generates, a flood beginning beside it: `on_pressure` says when to ask."""
        if self._running[tenant] != 1 or self._queue.waiting_of(tenant):
            return False
        now = time.monotonic()
        me = self._tenants[tenant]
        if now - me.last_refused < self.activity_s:
            return False
        mine = me.rate(now)
        for other, known in self._tenants.items():
            if other == tenant:
                continue
            if self._running[other] + self._queue.waiting_of(other) >= 2:
                return True
            if now - known.last_refused < self.activity_s:
                return True
            active = now - known.last_asked < self.activity_s
            if active and known.rate(now) >= _HEAVIER * mine:
                return True
        return False

    @contextlib.asynccontextmanager
    async def admit(self, deadline: float | None, tenant: str = "") -> AsyncIterator[Place]:
        """Holds a place while the run goes on; the caller marks it if it ran out of time."""
        started = time.monotonic()
        known = self._tenants.setdefault(tenant, _Tenant(started))
        known.asked(started)
        if len(self._tenants) > _TENANTS_KEPT:
            self._forget_idle_tenants(started)
        try:
            if (
                self._queue
                or self.in_flight >= self.max_in_flight
                or self._running[tenant] >= self.share(tenant, started)
            ):
                await self._wait(deadline, started, tenant)  # may be handed a place at once
            else:
                self._refuse_if_its_runs_run_out(deadline, started, tenant)
                self._take(tenant)
        except ResourceExhausted:
            known.last_refused = time.monotonic()
            self._pressed()
            raise
        if self._running[tenant] >= 2:
            self._pressed()
        place = Place(time.monotonic())
        beside = self._beside_others(tenant, place.admitted)
        try:
            yield place
        except DeadlineExceeded:
            place.ran_out = True
            raise
        finally:
            ended = time.monotonic()
            held = ended - place.admitted
            beside = beside or self._beside_others(tenant, ended)
            self._runs.append(held)
            known.runs.append(_Run(held, place.ran_out, beside))
            self._release(tenant)

    def _refuse_if_its_runs_run_out(
        self, deadline: float | None, started: float, tenant: str
    ) -> None:
        """A run with a place free is refused when most of its tenant's recent runs ran
        out of time and another of them is under way: it would most likely be cut too."""
        if deadline is None or not self._running[tenant] or not self.ran_out_mostly(tenant):
            return
        raise self._cannot_finish(
            tenant,
            f"most of this tenant's recent runs ran out of time (typically "
            f"{self.typical_run_s(tenant):.1f} s) and {self._running[tenant]} of them are "
            "under way",
            scope="tenant",
        )

    def _cannot_finish(self, tenant: str, why: str, scope: str = "") -> ResourceExhausted:
        """The refusal of a run that would not finish in time: `why`, and when to retry."""
        retry = self.retry_after_s(tenant)
        return ResourceExhausted(
            f"the orchestrator cannot finish this run in time: {why}; retry in about "
            f"{retry:.1f} s (or with a longer deadline)",
            retry_after_s=retry,
            reason="DEADLINE_TOO_SHORT_FOR_QUEUE",
            metadata={"queue": "orchestrator", **({"scope": scope} if scope else {})},
        )

    def _slow_run_said(self, tenant: str) -> str:
        """What a slow run of `tenant` takes now, in words (a refusal's reason)."""
        slow = self.slow_run_s(tenant)
        if math.isfinite(slow):
            return f"a run takes up to about {slow:.1f} s now"
        return "more than a tenth of this tenant's recent runs ran out of time"

    def _forget_idle_tenants(self, now: float) -> None:
        busy = set(self._running) | set(self._queue.keys())
        for tenant, known in list(self._tenants.items()):
            if tenant not in busy and now - known.last_asked > _FORGET_AFTER_S:
                del self._tenants[tenant]

    def _refuse_if_it_cannot_finish(self, deadline: float | None, started: float, tenant: str):
        """A run that must queue is refused when its wait and a slow run do not fit its
        deadline (with a place free it runs: it may be quick, a cache hit or an abstention),
        or when its tenant's runs were measured alone and other tenants are active now."""
        if deadline is None:
            return
        left = deadline - started
        wait = self.expected_wait_s(tenant)
        if wait + self.slow_run_s(tenant) > left:
            # It would only wait, or run, to time out: say so now, while a retry can help.
            raise self._cannot_finish(
                tenant,
                f"it would wait about {wait:.1f} s and {self._slow_run_said(tenant)}, more "
                f"than the {left:.1f} s its deadline leaves",
            )
        if self._measured_alone_only(tenant):
            # A flood beginning beside a light tenant queued on runs measured alone, which
            # then took twice as long: its queued runs were cut, or refused seconds late.
            raise self._cannot_finish(
                tenant,
                "this tenant's recent runs ran alone and other tenants are active now: how "
                "long its runs take beside them is not known yet (runs with a place free "
                "measure it)",
                scope="tenant",
            )

    async def _wait(self, deadline: float | None, started: float, tenant: str) -> None:
        retry = self.retry_after_s(tenant)
        if self.in_flight >= self.max_in_flight or self._running[tenant] >= self.share(tenant):
            self._refuse_if_it_cannot_finish(deadline, started, tenant)
        scope = self._queue.over_cap(tenant)
        if scope is not None:
            whose = "this tenant's" if scope == "tenant" else "the"
            limit = self._queue.max_per_tenant if scope == "tenant" else self._queue.max_total
            raise ResourceExhausted(
                f"the orchestrator is at capacity: {self.in_flight} runs in flight, "
                f"{whose} queue full ({limit} waiting); retry in about {retry:.1f} s",
                retry_after_s=retry,
                reason="QUEUE_FULL",
                metadata={"queue": "orchestrator", "scope": scope},
            )
        waiter = _Waiter(tenant, deadline, asyncio.get_running_loop().create_future())
        self._queue.push(tenant, waiter)
        self._hand_over()  # a free place another tenant's share kept may be this one's
        if not waiter.future.done():
            self._pressed()
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            self._abandon(waiter)
            raise DeadlineExceeded(
                f"deadline passed after {(time.monotonic() - started) * 1000:.0f} ms queued "
                "for admission, before any work"
            ) from None
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def _pressed(self) -> None:
        if self.on_pressure is not None:
            self.on_pressure()

    def _take(self, tenant: str) -> None:
        self.in_flight += 1
        self._running[tenant] += 1

    def _abandon(self, waiter: _Waiter) -> None:
        if self._queue.remove(waiter.tenant, waiter):
            return
        if waiter.future.done() and not waiter.future.cancelled():
            # Handed over as the waiter gave up: the place goes back (a refusal held none).
            if waiter.future.exception() is None:
                self._release(waiter.tenant)

    def _release(self, tenant: str) -> None:
        self.in_flight -= 1
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._hand_over()

    def _hand_over(self) -> None:
        now = time.monotonic()
        while self._queue and self.in_flight < self.max_in_flight:
            # The waiting tenant with the fewest runs in flight (the dict order breaks
            # ties), if it is under its share.
            tenant = self._queue.lightest(lambda t: self._running.get(t, 0))
            if self._running.get(tenant, 0) >= self.share(tenant, now):
                # The free place is an active tenant's share: kept for its next question,
                # until that tenant has been quiet for activity_s.
                self._recheck_later()
                return
            waiter = self._queue.pop(tenant)  # the tenant goes to the back of the round
            if waiter.future.done():
                continue
            if waiter.deadline is not None and waiter.deadline <= now:
                continue  # expired: dropped; its own wait ends with DEADLINE_EXCEEDED
            if waiter.deadline is not None and waiter.deadline - now < self.slow_run_s(
                waiter.tenant
            ):
                # Queued because its wait and a slow run fit; what was ahead of it took
                # longer, and a slow run no longer fits: the place goes to one that can
                # finish instead of to a run likely cut at its deadline.
                waiter.future.set_exception(
                    self._cannot_finish(
                        waiter.tenant,
                        f"it waited {now - waiter.queued:.1f} s for a place and "
                        f"{waiter.deadline - now:.1f} s of its deadline are left; "
                        f"{self._slow_run_said(waiter.tenant)}",
                    )
                )
                continue
            self._take(waiter.tenant)
            waiter.future.set_result(None)

    def _recheck_later(self) -> None:
        if self._recheck is None or self._recheck.cancelled():
            loop = asyncio.get_running_loop()
            self._recheck = loop.call_later(min(self.activity_s, 1.0), self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        self._hand_over()
