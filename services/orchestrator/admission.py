"""Admission of runs: a bounded number in flight, then a bounded queue whose entries carry
their deadline, then an immediate RESOURCE_EXHAUSTED with a retry delay. No gRPC here.

A queued run whose deadline passes leaves the queue with DEADLINE_EXCEEDED before any
work; a cancelled one just leaves. Nobody waits for a slot they could not use in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ragline.errors import DeadlineExceeded, ResourceExhausted


@dataclass
class _Waiter:
    deadline: float | None
    future: asyncio.Future = field(repr=False)


class Admission:
    def __init__(self, max_in_flight: int, max_queue: int, *, typical_run_s: float = 2.0):
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.in_flight = 0
        self._queue: deque[_Waiter] = deque()
        # Recent run time (moving average), for the retry delay of a refusal.
        self.typical_run_s = typical_run_s

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def retry_after_s(self) -> float:
        ahead = self.in_flight + len(self._queue) + 1 - self.max_in_flight
        return max(self.typical_run_s * ahead / max(self.max_in_flight, 1), 0.05)

    @contextlib.asynccontextmanager
    async def admit(self, deadline: float | None) -> AsyncIterator[float]:
        """Holds a place while the run goes on; yields the time it was admitted."""
        started = time.monotonic()
        if self.in_flight >= self.max_in_flight or self._queue:
            await self._wait(deadline, started)
        else:
            self.in_flight += 1
        admitted = time.monotonic()
        try:
            yield admitted
        finally:
            run_s = time.monotonic() - admitted
            self.typical_run_s = 0.8 * self.typical_run_s + 0.2 * run_s
            self._release()

    def expected_wait_s(self) -> float:
        """How long a run queued now would wait, from the recent run time."""
        ahead = len(self._queue) + 1
        return self.typical_run_s * ahead / max(self.max_in_flight, 1)

    async def _wait(self, deadline: float | None, started: float) -> None:
        retry = self.retry_after_s()
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(
                f"the orchestrator is at capacity: {self.in_flight} runs in flight, "
                f"{len(self._queue)} queued (limit {self.max_queue}); retry in about "
                f"{retry:.1f} s",
                retry_after_s=retry,
                reason="QUEUE_FULL",
                metadata={"queue": "orchestrator", "scope": "all"},
            )
        left = None if deadline is None else deadline - started
        if left is not None and self.expected_wait_s() + self.typical_run_s > left:
            # It would only wait to time out: say so now, while a retry elsewhere can help.
            raise ResourceExhausted(
                f"the orchestrator is busy: a run queued now would wait about "
                f"{self.expected_wait_s():.1f} s and take about {self.typical_run_s:.1f} s, "
                f"more than the {left:.1f} s its deadline leaves; retry in about {retry:.1f} s",
                retry_after_s=retry,
                reason="DEADLINE_TOO_SHORT_FOR_QUEUE",
                metadata={"queue": "orchestrator"},
            )
        waiter = _Waiter(deadline, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
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

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        elif waiter.future.done() and not waiter.future.cancelled():
            self._release()  # the place was handed over just as the waiter gave up

    def _release(self) -> None:
        self.in_flight -= 1
        now = time.monotonic()
        while self._queue and self.in_flight < self.max_in_flight:
            waiter = self._queue.popleft()
            if waiter.future.done():
                continue
            if waiter.deadline is not None and waiter.deadline <= now:
                continue  # expired: dropped; its own wait ends with DEADLINE_EXCEEDED
            self.in_flight += 1
            waiter.future.set_result(None)
