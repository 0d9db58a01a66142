"""The one retry rule of every outbound call.

What is retried:
- `UNAVAILABLE`: the server was not reached, is starting or shutting down.
- `RESOURCE_EXHAUSTED` and `ABORTED` only when the server sent a `google.rpc.RetryInfo`
  delay (a full queue that will drain, a ledger write that lost to another replica's).
  Without one (a refused task budget, a message over the transport cap) it is final.
- Nothing else: `DEADLINE_EXCEEDED` means the caller's time is gone, and every other code
  says the request itself is wrong or the server failed in a way a retry does not cure.

Backoff is exponential with full jitter, from `initial_backoff_s` up to `max_backoff_s`,
and never shorter than the server's RetryInfo delay. Retries share the caller's deadline:
a retry whose wait would end within a hop margin of the deadline is not made, and the
last error is raised. Only idempotent calls may be retried (ragline's writes are, by id).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ragline import deadlines

log = structlog.get_logger("ragline.retry")

T = TypeVar("T")


def retry_delay_of(error: grpc.aio.AioRpcError) -> float | None:
    """The google.rpc.RetryInfo delay a failed call carries, in seconds, if any."""
    # Read the details ourselves: rpc_status.from_call refuses trailers whose message differs
    # from the call's, which a proxy may rewrite, and the delay is still good.
    raw = next(
        (
            v
            for k, v in error.trailing_metadata() or ()
            if k == rpc_status.GRPC_DETAILS_METADATA_KEY
        ),
        None,
    )
    if not raw:
        return None
    try:
        status = status_pb2.Status.FromString(raw)
    except DecodeError:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return float(info.retry_delay.ToNanoseconds()) / 1e9
    return None


_RETRIED_WHEN_HINTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    # Codes retried unconditionally; these others when RetryInfo says when.
    retry_on: frozenset[grpc.StatusCode] = field(
        default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE})
    )

    def wait_before_retry(self, error: BaseException, attempt: int) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None when `error` is final."""
        if not isinstance(error, grpc.aio.AioRpcError) or attempt >= self.attempts:
            return None
        hinted = retry_delay_of(error)
        code = error.code()
        if code not in self.retry_on and not (code in _RETRIED_WHEN_HINTED and hinted is not None):
            return None
        ceiling = min(self.initial_backoff_s * self.multiplier ** (attempt - 1), self.max_backoff_s)
        return max(random.uniform(0, ceiling), hinted or 0.0)


DEFAULT_POLICY = RetryPolicy()
# Bulk loads (ingest) may wait longer for a busy service to drain.
PATIENT_POLICY = RetryPolicy(attempts=6, initial_backoff_s=0.5, max_backoff_s=10.0)


async def call_with_retry(
    attempt: Callable[[], Awaitable[T]],
    policy: RetryPolicy = DEFAULT_POLICY,
    *,
    what: str = "call",
    margin_s: float = 0.005,
) -> T:
    """Runs `attempt()` until it succeeds, fails for good, or the deadline leaves no time."""
    number = 1
    while True:
        try:
            return await attempt()
        except grpc.aio.AioRpcError as error:
            wait = policy.wait_before_retry(error, number)
            left = deadlines.remaining()
            if wait is None or (left is not None and wait + margin_s >= left):
                raise
            log.info(
                "retry",
                what=what,
                attempt=number,
                code=error.code().name,
                wait_ms=round(wait * 1000, 1),
            )
            await asyncio.sleep(wait)
            number += 1
