"""Deadline propagation (Python gRPC does not propagate deadlines by itself).

The server interceptor turns the incoming `time_remaining()` into an absolute monotonic
deadline in a context variable. Every outbound call asks `outbound_timeout()` for its
timeout: what remains minus a hop margin, capped by the stage budget; when nothing remains
it raises DeadlineExceeded and no call is made. asyncio's clock is `time.monotonic()`, so
the same absolute value works with `asyncio.timeout_at`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any, TypeVar

from ragline.errors import DeadlineExceeded, RaglineError, Unavailable

T = TypeVar("T")

# gRPC rounds the grpc-timeout header up (0.975 s arrives as ~1.0 s, 12.345 s as 12.4 s),
# which would let a callee believe it has more time than its caller gave it. ragline
# clients also send the exact timeout in microseconds; servers take the smaller of the two.
TIMEOUT_METADATA_KEY = "x-ragline-timeout-us"

_deadline: ContextVar[float | None] = ContextVar("ragline_deadline", default=None)


def now() -> float:
    return time.monotonic()


def current_deadline() -> float | None:
    """Absolute monotonic deadline of the work in progress, or None when unbounded."""
    return _deadline.get()


def remaining() -> float | None:
    """Seconds left before the deadline (may be negative), or None when unbounded."""
    deadline = _deadline.get()
    return None if deadline is None else deadline - now()


def expired() -> bool:
    left = remaining()
    return left is not None and left <= 0


def check(what: str) -> None:
    """Raises DeadlineExceeded before starting `what` when no time is left."""
    left = remaining()
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"deadline passed {-left * 1000:.0f} ms before {what} could start")


@contextmanager
def deadline_scope(timeout_s: float | None) -> Iterator[float | None]:
    """Narrows the deadline to `timeout_s` from now for the enclosed work (never widens it).

    A node's deadline is min(its stage budget, task deadline): nesting scopes gives that.
    """
    parent = _deadline.get()
    deadline = parent
    if timeout_s is not None:
        candidate = now() + timeout_s
        deadline = candidate if parent is None else min(parent, candidate)
    token = _deadline.set(deadline)
    try:
        yield deadline
    finally:
        _deadline.reset(token)


@contextmanager
def detached(timeout_s: float) -> Iterator[float]:
    """A fresh deadline `timeout_s` from now, whatever the caller's was.

    Only for bookkeeping that must happen after the work it accounts for ran out of time
    (settling a budget reservation); never for the work itself.
    """
    fresh = now() + timeout_s
    token = _deadline.set(fresh)
    try:
        yield fresh
    finally:
        _deadline.reset(token)


class StreamInterrupted(Exception):
    """`StreamDeadline.interrupt()` ended the read (the stream itself is still open)."""


class StreamDeadline:
    """One timer for a stream read piece by piece, with the reader's own code (a
    generator's `yield`) between the reads.

    `asyncio.timeout_at` around each read arms and cancels a timer per piece; one around
    the whole loop would cancel the reader's code, wherever it is, instead of the read.
    This arms one timer for the stream, and when it fires interrupts only a read in
    progress: that read (or the next one) raises TimeoutError. Another cancellation of
    the task (the caller went away) stays a CancelledError.

        with StreamDeadline(deadline) as timer:
            while True:
                item = await timer.read(stream)  # TimeoutError, StopAsyncIteration
                yield item
    """

    def __init__(self, when: float | None) -> None:
        self.when = when
        self.expired = False
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reading = False
        self._cancelled = False  # this timer's cancel is on its way to the read
        self._interrupted = False

    def __enter__(self) -> StreamDeadline:
        self._task = asyncio.current_task()
        if self.when is not None:
            self._timer = asyncio.get_running_loop().call_at(self.when, self._expire)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self.expired = True
        self._cancel_read()

    def interrupt(self) -> None:
        """Ends the read in progress, or the next one, with StreamInterrupted (a reader
        asked to stop now, its stream to be closed or read again later)."""
        self._interrupted = True
        self._cancel_read()

    def withdraw_interrupt(self) -> None:
        """Drops an interrupt that came while no read was in progress, once its reader
        has acted on what it asked by other means (else the next read would end at once)."""
        self._interrupted = False

    def _cancel_read(self) -> None:
        if self._reading and self._task is not None and not self._cancelled:
            self._cancelled = True
            self._task.cancel()

    async def read(self, stream: AsyncIterator[T]) -> T:
        if self.expired:
            raise TimeoutError
        if self._interrupted:
            self._interrupted = False
            raise StreamInterrupted
        self._reading = True
        try:
            return await anext(stream)
        except asyncio.CancelledError:
            # Ours only when no other cancellation was asked for meanwhile.
            if self._cancelled and self._task is not None and self._task.uncancel() == 0:
                self._cancelled = False
                if self.expired:
                    raise TimeoutError from None
                self._interrupted = False
                raise StreamInterrupted from None
            raise
        finally:
            self._reading = False


def set_deadline(deadline: float | None) -> Token[float | None]:
    """Sets the absolute deadline; returns a token for `reset_deadline`."""
    return _deadline.set(deadline)


def reset_deadline(token: Token[float | None]) -> None:
    _deadline.reset(token)


def deadline_from_grpc(
    time_remaining: float | None, default_timeout_s: float, exact_timeout_us: str | None = None
) -> float | None:
    """Absolute deadline for an incoming call.

    `time_remaining` is the grpc context's value (None when the caller set no deadline);
    `exact_timeout_us` the caller's TIMEOUT_METADATA_KEY value, if sent. Without either,
    `default_timeout_s` applies (0 means unbounded).
    """
    exact = _parse_timeout_us(exact_timeout_us)
    if exact is not None:
        time_remaining = exact if time_remaining is None else min(time_remaining, exact)
    if time_remaining is not None:
        return now() + max(time_remaining, 0.0)
    if default_timeout_s > 0:
        return now() + default_timeout_s
    return None


def _parse_timeout_us(value: str | None) -> float | None:
    if not value:
        return None
    try:
        micros = int(value)
    except ValueError:
        return None
    return micros / 1e6 if micros >= 0 else None


def timeout_metadata(timeout_s: float | None) -> tuple[tuple[str, str], ...]:
    """The exact-timeout metadata entry for an outbound call (empty when unbounded)."""
    if timeout_s is None:
        return ()
    return ((TIMEOUT_METADATA_KEY, str(int(timeout_s * 1e6))),)


def outbound_timeout(
    what: str, *, margin_s: float = 0.005, stage_budget_s: float | None = None
) -> float | None:
    """Timeout for an outbound call to `what`: remaining - margin, capped by the stage budget.

    Raises DeadlineExceeded (without calling) when nothing would remain. Returns None only
    when there is neither a deadline nor a stage budget.
    """
    left = remaining()
    candidates = []
    if left is not None:
        candidates.append(left - margin_s)
    if stage_budget_s is not None:
        candidates.append(stage_budget_s)
    if not candidates:
        return None
    timeout = min(candidates)
    if timeout <= 0:
        raise DeadlineExceeded(
            f"no time left to call {what}: {max(left or 0.0, 0.0) * 1000:.1f} ms remain and "
            f"{margin_s * 1000:.1f} ms are kept as hop margin"
        )
    return timeout


def timed_out(what: str, timeout: float | None, cap_s: float, detail: str = "") -> RaglineError:
    """The error for a call to `what` that ran out of its `timeout` (from `outbound_timeout`
    with `stage_budget_s=cap_s`): DEADLINE_EXCEEDED when that was the caller's remaining
    time, else UNAVAILABLE (the engine was slower than its own cap: retryable)."""
    if timeout is not None and timeout < cap_s:
        return DeadlineExceeded(f"{what}: the deadline passed")
    return Unavailable(f"{what}: {detail or f'no answer within {timeout} s'}")
