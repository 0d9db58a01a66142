"""The generation service's Triton adapter against the real tritonserver 2.51, streaming
from a decoupled python-backend model with the TensorRT-LLM ensemble tensor contract."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ragline.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.integration

ACME = (("x-ragline-tenant", "acme"),)


async def generate(address, request, deadline_s=30.0):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return [m async for m in stub.Generate(request, timeout=deadline_s, metadata=ACME)]


async def test_streams_every_piece_in_order_with_usage(generation_on_triton):
    messages = await generate(
        generation_on_triton.address,
        generation_pb2.GenerateRequest(prompt="alpha beta gamma", max_tokens=7),
    )
    chunks, final = messages[:-1], messages[-1].final
    assert [c.text for c in chunks] == [
        " alpha",
        " beta",
        " gamma",
        " alpha",
        " beta",
        " gamma",
        " alpha",
    ]
    assert chunks[0].first_token and [m.index for m in messages] == list(range(8))
    assert final.text == " alpha beta gamma alpha beta gamma alpha"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (3, 7)
    assert final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert final.model == "ensemble"


async def test_chat_is_rendered_as_chatml(generation_on_triton):
    request = generation_pb2.GenerateRequest(max_tokens=2)
    request.chat.messages.add(role=generation_pb2.ROLE_USER, content="hello there")
    messages = await generate(generation_on_triton.address, request)
    assert messages[0].text == " <|im_start|>user"


async def test_deadline_stops_the_triton_stream(generation_on_triton):
    started = time.monotonic()
    messages = await generate(
        generation_on_triton.address,
        generation_pb2.GenerateRequest(prompt="one two", max_tokens=1000),
        deadline_s=1.0,
    )
    assert time.monotonic() - started < 1.0
    final = messages[-1].final
    assert final.finish_reason == generation_pb2.FINISH_REASON_DEADLINE
    assert 5 < final.usage.output_tokens < 1000


async def test_cancel_frees_the_slot(generation_on_triton):
    async with grpc.aio.insecure_channel(generation_on_triton.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        calls = [
            stub.Generate(
                generation_pb2.GenerateRequest(prompt="x", max_tokens=3000),
                timeout=120,
                metadata=ACME,
            )
            for _ in range(2)
        ]
        for call in calls:
            await call.read()  # both slots busy
        for call in calls:
            call.cancel()
        await asyncio.sleep(0.1)
        messages = [
            m
            async for m in stub.Generate(
                generation_pb2.GenerateRequest(prompt="y", max_tokens=2), timeout=10, metadata=ACME
            )
        ]
    assert messages[-1].final.timing.queue_wait.ToNanoseconds() < 1e9


def test_generation_reaches_a_triton_under_mutual_tls(launcher, triton_starter, tmp_path):
    """RAGLINE_GENERATION_TRITON_TLS: the engine's channel to a real tritonserver serving
    gRPC under mutual TLS carries the service's certificate."""
    from ragline.clients import open_channel
    from ragline_app.certificates import local_authority
    from support import REPO_ROOT

    pki = local_authority(tmp_path / "pki")
    server = triton_starter(
        REPO_ROOT / "deploy" / "triton" / "generation" / "cpu",
        tmp_path / "triton",
        certificates=pki,
    )
    try:
        service = launcher.start(
            "generation",
            env={
                "RAGLINE_GENERATION_ENGINE": "triton",
                "RAGLINE_GENERATION_TRITON_URL": f"localhost:{server.grpc_port}",
                "RAGLINE_GENERATION_TRITON_TLS": "true",
                **pki.service_environment("mtls"),
            },
        )

        async def generated() -> str:
            async with open_channel(service.address, service.tls) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                request = generation_pb2.GenerateRequest(prompt="alpha beta", max_tokens=3)
                replies = [m async for m in stub.Generate(request, timeout=30, metadata=ACME)]
            return replies[-1].final.text

        assert asyncio.run(generated()) == " alpha beta alpha"
    finally:
        server.stop()
