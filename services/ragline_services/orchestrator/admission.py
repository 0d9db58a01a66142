"""Admission of runs: a bounded number in flight, then bounded queues (one per tenant) whose
entries carry their deadline, then an immediate RESOURCE_EXHAUSTED with a retry delay. No
gRPC here.

Goodput before throughput: a run that could only time out is refused at once, while a
retry elsewhere (or later) can still help: when what is ahead of it in the queue plus a
run's slow case (the 90th percentile of recent run times) does not fit its deadline. What is
admitted can finish; nothing is let in only to be cut at its deadline.

Run times (run_times.py) are measured per tenant as well as for everyone: a tenant's
runs can take far longer than the others' (a flood whose generations pause for a light
tenant's, a tenant whose questions need the large model), and a run its deadline cut
counts as one that did not fit (it needed more than it had). A tenant's run with a place
free is still refused when most of its recent runs ran out of time and another of its
runs is under way (that one keeps measuring, so the estimate follows when things get
faster); one that must queue is refused when its wait and its tenant's slow case do not
fit.

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

The queues are the kit's FairQueue; which tenant's run goes first beside a flood is
light_tenant.py's policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ragline.errors import DeadlineExceeded, ResourceExhausted
from ragline.fair_queue import FairQueue
from ragline_services.orchestrator import light_tenant
from ragline_services.orchestrator.run_times import RunTimes


@dataclass
class Place:
    """A run's place while it runs: when it was admitted, and whether its deadline cut it
    (the caller says so; a run that ends in DeadlineExceeded is one)."""

    admitted: float
    ran_out: bool = False


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
        self.times = RunTimes(typical_run_s, self._beside_others)
        self._recheck: asyncio.TimerHandle | None = None
        # Called when a tenant asks for more than it gets (a run refused, queued, or a
        # second one admitted): a run of another tenant may have turned light (`light`).
        self.on_pressure: Callable[[], None] | None = None

    @property
    def waiting(self) -> int:
        return self._queue.waiting

    def retry_after_s(self, tenant: str | None = None) -> float:
        ahead = self.in_flight + self.waiting + 1 - self.max_in_flight
        everyone = self.times.typical_s() * ahead / max(self.max_in_flight, 1)
        if tenant is None or self.times.own(tenant) is None:
            return max(everyone, 0.05)
        # Its own place frees when one of its runs ends.
        own = self.times.typical_s(tenant) / max(self._running[tenant], 1)
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
            return self.times.mean_s(tenant) * ahead / share
        return self.times.mean_s() * ahead / self.max_in_flight

    def share(self, tenant: str, now: float | None = None) -> int:
        """The places `tenant` may hold now: all of them while it is the only active tenant,
        else its equal share (at least one)."""
        return max(1, self.max_in_flight // len(self._active(tenant, now)))

    def _active(self, tenant: str, now: float | None = None) -> set[str]:
        """The tenants active now (asked within activity_s, running or waiting), `tenant`
        among them."""
        now = time.monotonic() if now is None else now
        active = {t for t, k in self.times.tenants.items() if now - k.last_asked < self.activity_s}
        return active | set(self._running) | set(self._queue.keys()) | {tenant}

    def _beside_others(self, tenant: str, now: float | None = None) -> bool:
        return len(self._active(tenant, now)) > 1

    def light(self, tenant: str) -> bool:
        """Whether `tenant`'s run goes first beside a flood now (light_tenant.py). A run may
        turn light while it generates, a flood beginning beside it: `on_pressure` says when
        to ask."""
        return light_tenant.is_light(
            tenant,
            running=self._running,
            waiting_of=self._queue.waiting_of,
            tenants=self.times.tenants,
            now=time.monotonic(),
            activity_s=self.activity_s,
        )

    @contextlib.asynccontextmanager
    async def admit(self, deadline: float | None, tenant: str = "") -> AsyncIterator[Place]:
        """Holds a place while the run goes on; the caller marks it if it ran out of time."""
        started = time.monotonic()
        known = self.times.asked(tenant, started)
        self.times.forget_idle(started, lambda: set(self._running) | set(self._queue.keys()))
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
            self.times.ended(known, held, place.ran_out, beside)
            self._release(tenant)

    def _refuse_if_its_runs_run_out(
        self, deadline: float | None, started: float, tenant: str
    ) -> None:
        """A run with a place free is refused when most of its tenant's recent runs ran
        out of time and another of them is under way: it would most likely be cut too."""
        if deadline is None or not self._running[tenant] or not self.times.ran_out_mostly(tenant):
            return
        raise self._cannot_finish(
            tenant,
            f"most of this tenant's recent runs ran out of time (typically "
            f"{self.times.typical_s(tenant):.1f} s) and {self._running[tenant]} of them are "
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
        slow = self.times.slow_s(tenant)
        if math.isfinite(slow):
            return f"a run takes up to about {slow:.1f} s now"
        return "more than a tenth of this tenant's recent runs ran out of time"

    def _refuse_if_it_cannot_finish(self, deadline: float | None, started: float, tenant: str):
        """A run that must queue is refused when its wait and a slow run do not fit its
        deadline (with a place free it runs: it may be quick, a cache hit or an abstention),
        or when its tenant's runs were measured alone and other tenants are active now."""
        if deadline is None:
            return
        left = deadline - started
        wait = self.expected_wait_s(tenant)
        if wait + self.times.slow_s(tenant) > left:
            # It would only wait, or run, to time out: say so now, while a retry can help.
            raise self._cannot_finish(
                tenant,
                f"it would wait about {wait:.1f} s and {self._slow_run_said(tenant)}, more "
                f"than the {left:.1f} s its deadline leaves",
            )
        if self.times.measured_alone_only(tenant):
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
            if waiter.deadline is not None and waiter.deadline - now < self.times.slow_s(
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
