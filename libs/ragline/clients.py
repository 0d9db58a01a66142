"""Async clients of the ragline services, with channel reuse and deadline propagation.

Every call: timeout = the current deadline's remaining time - hop margin (capped by an
optional stage budget), or DEADLINE_EXCEEDED without calling when nothing is left; the
caller's identity and run id travel in metadata. Cancelling the awaiting task cancels the
RPC, and the callee sees the cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from ragline import deadlines, identity
from ragline.config import CommonConfig

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


class ChannelPool:
    """One channel per target per event loop (an aio channel is bound to its loop)."""

    def __init__(self) -> None:
        self._channels: dict[tuple[int, str], grpc.aio.Channel] = {}

    def get(self, target: str) -> grpc.aio.Channel:
        key = (id(asyncio.get_running_loop()), target)
        channel = self._channels.get(key)
        if channel is None:
            channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
            self._channels[key] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


default_pool = ChannelPool()


class ServiceClient:
    """Base of the per-service clients: deadline- and identity-aware unary and stream calls."""

    service: str = ""

    def __init__(
        self,
        target: str,
        *,
        pool: ChannelPool | None = None,
        hop_margin_s: float = 0.005,
        caller: identity.Caller | None = None,
    ) -> None:
        self.target = target
        self._pool = pool or default_pool
        self._hop_margin_s = hop_margin_s
        self._caller = caller
        self._stub_cache: tuple[grpc.aio.Channel, object] | None = None

    def _stub_class(self):
        raise NotImplementedError

    def _stub(self):
        channel = self._pool.get(self.target)
        if self._stub_cache is None or self._stub_cache[0] is not channel:
            self._stub_cache = (channel, self._stub_class()(channel))
        return self._stub_cache[1]

    def _call_options(
        self, method: str, stage_budget_s: float | None, detached_timeout_s: float | None = None
    ):
        if detached_timeout_s is not None:
            # Bookkeeping that must outlive the caller's deadline (budget settlement).
            timeout = detached_timeout_s
        else:
            timeout = deadlines.outbound_timeout(
                f"{self.service}.{method}",
                margin_s=self._hop_margin_s,
                stage_budget_s=stage_budget_s,
            )
        metadata = identity.outbound_metadata()
        if self._caller is not None:
            # An explicit caller (a CLI, a test) replaces the propagated identity.
            metadata = [kv for kv in metadata if kv[0] == identity.RUN_ID_KEY]
            metadata.extend(self._caller.metadata())
        return timeout, (*metadata, *deadlines.timeout_metadata(timeout))

    async def unary(
        self,
        method: str,
        request,
        *,
        stage_budget_s: float | None = None,
        detached_timeout_s: float | None = None,
    ):
        timeout, metadata = self._call_options(method, stage_budget_s, detached_timeout_s)
        return await getattr(self._stub(), method)(request, timeout=timeout, metadata=metadata)

    async def stream(
        self, method: str, request, *, stage_budget_s: float | None = None
    ) -> AsyncIterator:
        timeout, metadata = self._call_options(method, stage_budget_s)
        call = getattr(self._stub(), method)(request, timeout=timeout, metadata=metadata)
        try:
            async for message in call:
                yield message
        finally:
            # The consumer stopped early or was cancelled: stop the server's work too.
            call.cancel()


class EmbeddingClient(ServiceClient):
    service = "embedding"

    def _stub_class(self):
        from ragline.v1 import embedding_pb2_grpc

        return embedding_pb2_grpc.EmbeddingServiceStub

    async def embed(self, request, **kwargs):
        return await self.unary("Embed", request, **kwargs)


class RetrievalClient(ServiceClient):
    service = "retrieval"

    def _stub_class(self):
        from ragline.v1 import retrieval_pb2_grpc

        return retrieval_pb2_grpc.RetrievalServiceStub

    async def upsert(self, request, **kwargs):
        return await self.unary("Upsert", request, **kwargs)

    async def delete(self, request, **kwargs):
        return await self.unary("Delete", request, **kwargs)

    async def search(self, request, **kwargs):
        return await self.unary("Search", request, **kwargs)

    async def index_status(self, request, **kwargs):
        return await self.unary("IndexStatus", request, **kwargs)


class RerankClient(ServiceClient):
    service = "rerank"

    def _stub_class(self):
        from ragline.v1 import rerank_pb2_grpc

        return rerank_pb2_grpc.RerankServiceStub

    async def rerank(self, request, **kwargs):
        return await self.unary("Rerank", request, **kwargs)


class GenerationClient(ServiceClient):
    service = "generation"

    def _stub_class(self):
        from ragline.v1 import generation_pb2_grpc

        return generation_pb2_grpc.GenerationServiceStub

    def generate(self, request, **kwargs) -> AsyncIterator:
        return self.stream("Generate", request, **kwargs)

    async def count_tokens(self, request, **kwargs):
        return await self.unary("CountTokens", request, **kwargs)


class BudgetClient(ServiceClient):
    service = "budget"

    def _stub_class(self):
        from ragline.v1 import budget_pb2_grpc

        return budget_pb2_grpc.BudgetServiceStub

    async def open_task(self, request, **kwargs):
        return await self.unary("OpenTask", request, **kwargs)

    async def reserve(self, request, **kwargs):
        return await self.unary("Reserve", request, **kwargs)

    async def settle(self, request, **kwargs):
        return await self.unary("Settle", request, **kwargs)

    async def cancel(self, request, **kwargs):
        return await self.unary("Cancel", request, **kwargs)

    async def get_ledger(self, request, **kwargs):
        return await self.unary("GetLedger", request, **kwargs)

    async def close_task(self, request, **kwargs):
        return await self.unary("CloseTask", request, **kwargs)


class OrchestratorClient(ServiceClient):
    service = "orchestrator"

    def _stub_class(self):
        from ragline.v1 import orchestrator_pb2_grpc

        return orchestrator_pb2_grpc.OrchestratorServiceStub

    def ask(self, request, **kwargs) -> AsyncIterator:
        return self.stream("Ask", request, **kwargs)


CLIENTS: dict[str, type[ServiceClient]] = {
    cls.service: cls
    for cls in (
        EmbeddingClient,
        RetrievalClient,
        RerankClient,
        GenerationClient,
        BudgetClient,
        OrchestratorClient,
    )
}


def client_for(service: str, common: CommonConfig | None = None, **kwargs) -> ServiceClient:
    """A client of `service` at the address the common config gives."""
    common = common or CommonConfig()
    return CLIENTS[service](common.address_of(service), hop_margin_s=common.hop_margin_s, **kwargs)
