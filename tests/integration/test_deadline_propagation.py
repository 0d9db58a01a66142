"""Deadline rules across a real gRPC hop: caller -> relay (A) -> callee (B), on loopback.

A and B run the service kit (interceptor, bootstrap) in this process; A forwards each
Embed call to B through the kit's EmbeddingClient.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline import deadlines
from ragline.clients import ChannelPool, EmbeddingClient
from ragline.config import CommonConfig, ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.server.bootstrap import ServerRunner
from ragline.v1 import embedding_pb2, embedding_pb2_grpc

pytestmark = pytest.mark.integration

MARGIN_S = 0.02


class CalleeServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    def __init__(self) -> None:
        self.calls = 0
        self.seen_time_remaining: list[float | None] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.hold_s = 0.0

    async def Embed(self, request, context):
        self.calls += 1
        # The deadline the kit derived (the exact one, not gRPC's rounded-up header).
        self.seen_time_remaining.append(deadlines.remaining())
        self.started.set()
        try:
            await asyncio.sleep(self.hold_s)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return embedding_pb2.EmbedResponse(model="callee")


class RelayServicer(embedding_pb2_grpc.EmbeddingServiceServicer):
    def __init__(self, client: EmbeddingClient) -> None:
        self.client = client
        self.remaining_before_call: list[float | None] = []
        # Seconds of the deadline to burn before forwarding (simulates slow local work).
        self.burn_until_left_s: float | None = None
        self.stage_budget_s: float | None = None

    async def Embed(self, request, context):
        if self.burn_until_left_s is not None:
            await asyncio.sleep(max(deadlines.remaining() - self.burn_until_left_s, 0))
        self.remaining_before_call.append(deadlines.remaining())
        return await self.client.embed(request, stage_budget_s=self.stage_budget_s)


class _TestConfig(ServiceConfig):
    service_name = "test"
    port: int = 0
    grace_s: float = 0.5


def _spec(servicer) -> ServiceSpec:
    class _Service(Service):
        def register(self, server):
            embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(servicer, server)

    return ServiceSpec(
        name="test",
        grpc_service="ragline.v1.EmbeddingService",
        config_factory=_TestConfig,
        service_factory=_Service,
    )


@pytest.fixture
async def hop():
    pool = ChannelPool()
    callee = CalleeServicer()
    callee_runner = ServerRunner(_spec(callee), _TestConfig(), CommonConfig())
    callee_port = await callee_runner.start()
    relay = RelayServicer(
        EmbeddingClient(f"127.0.0.1:{callee_port}", pool=pool, hop_margin_s=MARGIN_S)
    )
    relay_runner = ServerRunner(_spec(relay), _TestConfig(), CommonConfig())
    relay_port = await relay_runner.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{relay_port}")
    stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
    yield stub, relay, callee
    await channel.close()
    await relay_runner.stop()
    await callee_runner.stop()
    await pool.close()


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
