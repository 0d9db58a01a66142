"""Admission of runs: a bounded number in flight, then bounded queues (one per tenant) whose
entries carry their deadline, then an immediate RESOURCE_EXHAUSTED with a retry delay. No
gRPC here.

Goodput before throughput: a run that could only time out is refused at once, while a
retry elsewhere (or later) can still help: when what is ahead of it in the queue plus a
run's slow case (the 90th percentile of recent run times) does not fit its deadline. What is
admitted can finish; nothing is let in only to be cut at its deadline.

Fairness between tenants: each tenant queues apart (at most `max_queue_per_tenant`, so a
flood cannot fill the queue for everyone), and a freed place goes to the waiting tenant with
the fewest runs in flight (round robin among equals). While several tenants are active
(asked within the last `activity_s`), each may hold at most its share of the places
(max_in_flight / active tenants, at least one): a flooding tenant then leaves a quiet one's
share free for its next question instead of taking every place that frees. A tenant alone
uses every place.

A queued run whose deadline passes leaves the queue with DEADLINE_EXCEEDED before any work;
a cancelled one just leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from ragline.errors import DeadlineExceeded, ResourceExhausted

# Recent runs whose durations set the expected and the slow run time.
_WINDOW = 64


@dataclass
class _Waiter:
    tenant: str
    deadline: float | None
    future: asyncio.Future = field(repr=False)


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
        self.max_queue = max_queue
        self.max_queue_per_tenant = max_queue_per_tenant or max((max_queue + 1) // 2, 1)
        self.activity_s = activity_s
        self.in_flight = 0
        self._running: Counter[str] = Counter()  # runs in flight per tenant
        # Waiters by tenant; the dict's order is the round-robin order among equals.
        self._queues: dict[str, deque[_Waiter]] = {}
        self._runs: deque[float] = deque([typical_run_s], maxlen=_WINDOW)
        self._last_asked: dict[str, float] = {}  # when each tenant last asked
        self._recheck: asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def typical_run_s(self) -> float:
        """The median of recent run times."""
        return float(np.median(self._runs))

    @property
    def mean_run_s(self) -> float:
        """The mean of recent run times: k runs ahead take about k of it in all (the
        median undercounts when quick abstentions sit beside slow answers)."""
        return float(np.mean(self._runs))

    @property
    def slow_run_s(self) -> float:
        """The 90th percentile of recent run times: what a run admitted now must be ready
        to take."""
        return float(np.percentile(self._runs, 90))

    def retry_after_s(self) -> float:
        ahead = self.in_flight + self.waiting + 1 - self.max_in_flight
        return max(self.typical_run_s * ahead / max(self.max_in_flight, 1), 0.05)

    def expected_wait_s(self, tenant: str = "") -> float:
        """How long a run of `tenant` queued now would wait: nothing while a place within
        its share is free; else its queued runs and this one drain through the places it
        may hold (its share; one of all of them when the share is not what blocks it),
        one mean run each."""
        share = self.share(tenant)
        if self.in_flight < self.max_in_flight and self._running[tenant] < share:
            return 0.0
        places = share if self._running[tenant] >= share else self.max_in_flight
        ahead = len(self._queues.get(tenant, ())) + 1
        return self.mean_run_s * ahead / places

    def share(self, tenant: str, now: float | None = None) -> int:
        """The places `tenant` may hold now: all of them while it is the only active tenant,
        else its equal share (at least one)."""
        now = time.monotonic() if now is None else now
        active = {t for t, at in self._last_asked.items() if now - at < self.activity_s}
        active |= set(self._running) | set(self._queues) | {tenant}
        return max(1, self.max_in_flight // len(active))

    def light(self, tenant: str) -> bool:
        """Whether `tenant`, its run admitted, is a light tenant beside a flood: no other
        run of its own in flight or waiting, while another tenant has two or more. Its
        generation goes first (GenerateRequest.light_tenant)."""
        if self._running[tenant] != 1 or self._queues.get(tenant):
            return False
        others = (set(self._running) | set(self._queues)) - {tenant}
        return any(self._running[t] + len(self._queues.get(t, ())) >= 2 for t in others)

    @contextlib.asynccontextmanager
    async def admit(self, deadline: float | None, tenant: str = "") -> AsyncIterator[float]:
        """Holds a place while the run goes on; yields the time it was admitted."""
        started = time.monotonic()
        self._last_asked[tenant] = started
        if (
            self._queues
            or self.in_flight >= self.max_in_flight
            or self._running[tenant] >= self.share(tenant, started)
        ):
            await self._wait(deadline, started, tenant)  # may be handed a place at once
        else:
            self._take(tenant)
        admitted = time.monotonic()
        try:
            yield admitted
        finally:
            self._runs.append(time.monotonic() - admitted)
            self._release(tenant)

    def _refuse_if_it_cannot_finish(self, deadline: float | None, started: float, tenant: str):
        """A run that must queue is refused when its wait and a slow run do not fit its
        deadline (with a place free it runs: it may be quick, a cache hit or an abstention)."""
        if deadline is None:
            return
        left = deadline - started
        wait = self.expected_wait_s(tenant)
        if wait + self.slow_run_s <= left:
            return
        retry = self.retry_after_s()
        # It would only wait, or run, to time out: say so now, while a retry can help.
        raise ResourceExhausted(
            f"the orchestrator cannot finish this run in time: it would wait about "
            f"{wait:.1f} s and a run takes up to about {self.slow_run_s:.1f} s now, more "
            f"than the {left:.1f} s its deadline leaves; retry in about {retry:.1f} s (or "
            "with a longer deadline)",
            retry_after_s=retry,
            reason="DEADLINE_TOO_SHORT_FOR_QUEUE",
            metadata={"queue": "orchestrator"},
        )

    async def _wait(self, deadline: float | None, started: float, tenant: str) -> None:
        retry = self.retry_after_s()
        if self.in_flight >= self.max_in_flight or self._running[tenant] >= self.share(tenant):
            self._refuse_if_it_cannot_finish(deadline, started, tenant)
        mine = len(self._queues.get(tenant, ()))
        if mine >= self.max_queue_per_tenant or self.waiting >= self.max_queue:
            scope = "tenant" if mine >= self.max_queue_per_tenant else "all"
            whose = "this tenant's" if scope == "tenant" else "the"
            limit = self.max_queue_per_tenant if scope == "tenant" else self.max_queue
            raise ResourceExhausted(
                f"the orchestrator is at capacity: {self.in_flight} runs in flight, "
                f"{whose} queue full ({limit} waiting); retry in about {retry:.1f} s",
                retry_after_s=retry,
                reason="QUEUE_FULL",
                metadata={"queue": "orchestrator", "scope": scope},
            )
        waiter = _Waiter(tenant, deadline, asyncio.get_running_loop().create_future())
        self._queues.setdefault(tenant, deque()).append(waiter)
        self._hand_over()  # a free place another tenant's share kept may be this one's
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

    def _take(self, tenant: str) -> None:
        self.in_flight += 1
        self._running[tenant] += 1

    def _abandon(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.tenant]
        elif waiter.future.done() and not waiter.future.cancelled():
            self._release(waiter.tenant)  # the place was handed over as the waiter gave up

    def _release(self, tenant: str) -> None:
        self.in_flight -= 1
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._hand_over()

    def _hand_over(self) -> None:
        now = time.monotonic()
        while self._queues and self.in_flight < self.max_in_flight:
            # The waiting tenant with the fewest runs in flight (the dict order breaks
            # ties), if it is under its share.
            tenant = min(self._queues, key=lambda t: self._running.get(t, 0))
            if self._running.get(tenant, 0) >= self.share(tenant, now):
                # The free place is an active tenant's share: kept for its next question,
                # until that tenant has been quiet for activity_s.
                self._recheck_later()
                return
            queue = self._queues.pop(tenant)
            waiter = queue.popleft()
            if queue:
                self._queues[tenant] = queue  # to the back of the round
            if waiter.future.done():
                continue
            if waiter.deadline is not None and waiter.deadline <= now:
                continue  # expired: dropped; its own wait ends with DEADLINE_EXCEEDED
            self._take(waiter.tenant)
            waiter.future.set_result(None)

    def _recheck_later(self) -> None:
        if self._recheck is None or self._recheck.cancelled():
            loop = asyncio.get_running_loop()
            self._recheck = loop.call_later(min(self.activity_s, 1.0), self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        self._hand_over()
