"""A generation service in front of the real one, for tests that need the model to say
something on cue (a malformed plan, a citation outside the evidence): requests `script`
answers get its text; every other request goes to the real service unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from ragline.processes import free_ports
from ragline.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# request -> the text the "model" answers, or None to forward the request
Script = Callable[[generation_pb2.GenerateRequest], str | None]


class GenerationProxy(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, upstream: str, script: Script, *, large_as_small: bool = False) -> None:
        """`large_as_small`: the upstream serves one tier; the proxy plays the large tier
        with it (requests for large are forwarded as small)."""
        self.upstream = upstream
        self.script = script
        self.large_as_small = large_as_small
        self.scripted: list[generation_pb2.GenerateRequest] = []
        self.scripted_for: list[str] = []  # the tenant of each scripted request
        self.forwarded: list[generation_pb2.GenerateRequest] = []
        self.hold_s = 0.0  # a scripted answer waits this long before its first word
        # ... or as long as this says for its request, where set
        self.hold_for: Callable[[generation_pb2.GenerateRequest], float] | None = None
        self.in_flight = 0  # Generate calls open now, and the most at once
        self.most_in_flight = 0
        self.port = free_ports(1)[0]
        self._channel = grpc.aio.insecure_channel(upstream)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
        await self._channel.close()

    async def Generate(self, request, context):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            async for message in self._generate(request, context):
                yield message
        finally:
            self.in_flight -= 1

    async def _generate(self, request, context):
        text = self.script(request)
        if text is None:
            self.forwarded.append(request)
            request = self._tier_mapped(request)
            metadata = tuple(
                (m.key, m.value)
                for m in context.invocation_metadata()
                if m.key.startswith("x-ragline-")
            )
            async for message in self._stub.Generate(
                request, timeout=context.time_remaining(), metadata=metadata
            ):
                yield message
            return
        self.scripted.append(request)
        metadata = dict(context.invocation_metadata())
        self.scripted_for.append(str(metadata.get("x-ragline-tenant", "")))
        await asyncio.sleep(self.hold_s if self.hold_for is None else self.hold_for(request))
        yield generation_pb2.GenerateResponse(text=text, first_token=True, index=0)
        final = generation_pb2.GenerateFinal(
            finish_reason=generation_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(input_tokens=100, output_tokens=len(text.split())),
            model="scripted",
            model_version="scripted@1",
            tier=request.tier or common_pb2.MODEL_TIER_SMALL,
            text=text,
        )
        yield generation_pb2.GenerateResponse(index=1, final=final)

    async def CountTokens(self, request, context):
        metadata = tuple(
            (m.key, m.value)
            for m in context.invocation_metadata()
            if m.key.startswith("x-ragline-")
        )
        return await self._stub.CountTokens(
            self._tier_mapped(request), timeout=10, metadata=metadata
        )

    def _tier_mapped(self, request):
        if self.large_as_small and request.tier == common_pb2.MODEL_TIER_LARGE:
            request = type(request).FromString(request.SerializeToString())
            request.tier = common_pb2.MODEL_TIER_SMALL
        return request


def is_planning(request: generation_pb2.GenerateRequest) -> bool:
    messages = request.chat.messages
    return bool(messages) and messages[0].content.startswith("Split the user's question")
