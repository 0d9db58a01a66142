"""Deadline rules across a real gRPC hop: caller -> relay (A) -> callee (B), on loopback.

A and B run the service kit (interceptor, bootstrap) in this process; A forwards each
Embed call to B through the kit's ServiceClient (the `hop` fixture, support/relay.py).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline.v1 import embedding_pb2
from support.relay import MARGIN_S

pytestmark = pytest.mark.integration

REQUEST = embedding_pb2.EmbedRequest(texts=["hello"])


async def test_child_timeout_never_exceeds_parent_remaining(hop):
    stub, relay, callee = hop
    reply = await stub.Embed(REQUEST, timeout=3.0)
    assert reply.model == "callee"
    parent_left = relay.remaining_before_call[0]
    child_left = callee.seen_time_remaining[0]
    assert parent_left is not None and child_left is not None
    assert child_left <= parent_left - MARGIN_S + 0.001
    assert child_left > 1.0  # the deadline was propagated, not replaced by a small default


@pytest.mark.parametrize("timeout_s", [0.2, 0.975, 12.345])
async def test_rounded_grpc_timeout_does_not_widen_the_child_deadline(hop, timeout_s):
    stub, relay, callee = hop
    await stub.Embed(REQUEST, timeout=timeout_s)
    assert callee.seen_time_remaining[0] <= relay.remaining_before_call[0] - MARGIN_S + 0.001


async def test_stage_budget_caps_child_timeout(hop):
    stub, relay, callee = hop
    relay.stage_budget_s = 0.3
    await stub.Embed(REQUEST, timeout=5.0)
    assert callee.seen_time_remaining[0] <= 0.3


async def test_expired_deadline_makes_no_call(hop):
    stub, relay, callee = hop
    relay.burn_until_left_s = MARGIN_S / 2  # less than the hop margin remains when it forwards
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(REQUEST, timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.1)
    assert callee.calls == 0


async def test_no_deadline_from_caller_gets_the_server_default(hop):
    stub, _, callee = hop
    await stub.Embed(REQUEST)  # no timeout: the relay applies default_deadline_s (120 s)
    assert callee.seen_time_remaining[0] is not None
    assert 100 < callee.seen_time_remaining[0] <= 120


async def test_cancellation_reaches_the_callee(hop):
    stub, _, callee = hop
    callee.hold_s = 30.0
    call = stub.Embed(REQUEST, timeout=20.0)
    await asyncio.wait_for(callee.started.wait(), timeout=5)
    call.cancel()
    await asyncio.wait_for(callee.cancelled.wait(), timeout=5)
    assert callee.cancelled.is_set()


async def test_deadline_expiry_in_callee_reaches_the_caller_as_deadline_exceeded(hop):
    stub, _, callee = hop
    callee.hold_s = 5.0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Embed(REQUEST, timeout=0.4)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(callee.cancelled.wait(), timeout=5)
