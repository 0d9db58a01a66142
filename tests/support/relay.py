"""Two kit servers in one process for the deadline tests: a relay (A) that forwards each
Embed call to a callee (B) through the kit's client."""

from __future__ import annotations

import asyncio

from ragline import deadlines
from ragline.clients import ServiceClient
from ragline.config import ServiceConfig
from ragline.server import Service, ServiceSpec
from ragline.v1 import embedding_pb2, embedding_pb2_grpc

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
    def __init__(self, client: ServiceClient) -> None:
        self.client = client
        self.remaining_before_call: list[float | None] = []
        # Seconds of the deadline to burn before forwarding (simulates slow local work).
        self.burn_until_left_s: float | None = None
        self.stage_budget_s: float | None = None

    async def Embed(self, request, context):
        if self.burn_until_left_s is not None:
            await asyncio.sleep(max(deadlines.remaining() - self.burn_until_left_s, 0))
        self.remaining_before_call.append(deadlines.remaining())
        return await self.client.unary("Embed", request, stage_budget_s=self.stage_budget_s)


class KitTestConfig(ServiceConfig):
    grace_s: float = 0.5


def kit_spec(servicer) -> ServiceSpec:
    """A service made of one EmbeddingService servicer on the kit's bootstrap."""

    class _Service(Service):
        def register(self, server):
            embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server(servicer, server)

    return ServiceSpec(
        name="test",
        grpc_service="ragline.v1.EmbeddingService",
        config_factory=KitTestConfig,
        service_factory=_Service,
    )
