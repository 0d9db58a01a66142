from __future__ import annotations

import grpc
import pytest
from grpc_status import rpc_status

from ragline import deadlines
from ragline.errors import ResourceExhausted, to_rpc_status
from ragline.retry import RetryPolicy, call_with_retry, retry_delay_of


def rpc_error(code: grpc.StatusCode, retry_after_s: float | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if retry_after_s is not None:
        _, _, status = to_rpc_status(ResourceExhausted("queue full", retry_after_s=retry_after_s))
        for key, value in rpc_status.to_status(status).trailing_metadata:
            trailing.add(key, value)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details="x")


POLICY = RetryPolicy(attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002)


def test_which_errors_a_retry_can_cure():
    assert POLICY.wait_before_retry(rpc_error(grpc.StatusCode.UNAVAILABLE), 1) is not None
    # A full queue that says when to come back: retried, never sooner than it said.
    hinted = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_s=0.25)
    assert retry_delay_of(hinted) == pytest.approx(0.25)
    assert POLICY.wait_before_retry(hinted, 1) >= 0.25
    # A ledger write that lost to another replica's (CONFLICT, with its delay): retried.
    conflict = rpc_error(grpc.StatusCode.ABORTED, retry_after_s=0.05)
    assert POLICY.wait_before_retry(conflict, 1) >= 0.05
    # A refused budget (no RetryInfo), a bad request, a passed deadline: final.
    for code in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
    ):
        assert POLICY.wait_before_retry(rpc_error(code), 1) is None, code
    assert POLICY.wait_before_retry(rpc_error(grpc.StatusCode.UNAVAILABLE), 3) is None


async def test_retries_until_success_within_the_attempts():
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        return "ok"

    assert await call_with_retry(flaky, POLICY) == "ok"
    assert len(calls) == 3


async def test_retries_share_the_callers_deadline():
    calls = []

    async def full_queue():
        calls.append(1)
        raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_s=1.0)

    # The server asks for 1 s; only 0.2 s remain: no retry is made, the refusal surfaces.
    with deadlines.deadline_scope(0.2), pytest.raises(grpc.aio.AioRpcError) as caught:
        await call_with_retry(full_queue, POLICY)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(calls) == 1
