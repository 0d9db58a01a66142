"""Bad input reaches a clear status from a real service process, with the field named."""

from __future__ import annotations

import grpc
import pytest

from ragline.v1 import (
    embedding_pb2,
    embedding_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    retrieval_pb2,
    retrieval_pb2_grpc,
)
from support import field_violations

pytestmark = pytest.mark.integration

TENANT = (("x-ragline-tenant", "acme"),)


async def test_oversized_request_is_invalid_argument_naming_the_field(small_embedding):
    async with grpc.aio.insecure_channel(small_embedding.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        request = embedding_pb2.EmbedRequest(texts=["x" * 1000] * 8)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("texts: request is ")
    assert "limit of 4096 bytes" in caught.value.details()
    assert "texts" in field_violations(caught.value)


async def test_request_over_transport_cap_is_refused_by_grpc(small_embedding):
    async with grpc.aio.insecure_channel(small_embedding.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(embedding_pb2.EmbedRequest(texts=["x" * 100_000]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_oversized_field_and_unknown_enum_and_missing_field(all_services):
    async with grpc.aio.insecure_channel(all_services["retrieval"].address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        request = retrieval_pb2.SearchRequest(query="q" * 5000, k=10, mode=42)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Search(request, timeout=10, metadata=TENANT)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations = field_violations(caught.value)
        assert violations["query"] == "is 5000 bytes; the limit is 4096 bytes"
        assert violations["mode"].startswith("unknown enum value 42; expected one of")

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Search(retrieval_pb2.SearchRequest(query="q"), timeout=10, metadata=TENANT)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(caught.value) == {"k": "is required; the minimum is 1"}

        upsert = retrieval_pb2.UpsertRequest()
        upsert.documents.add(id="a", text="fine")
        upsert.documents.add(id="b")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Upsert(upsert, timeout=10, metadata=TENANT)
        assert field_violations(caught.value) == {
            "documents[1].text": "is required and must not be empty"
        }


async def test_streaming_rpc_validates_before_streaming(all_services):
    async with grpc.aio.insecure_channel(all_services["generation"].address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Generate(generation_pb2.GenerateRequest(max_tokens=0), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set(field_violations(caught.value)) == {"input", "max_tokens"}


async def test_malformed_tenant_metadata_is_invalid_argument(all_services):
    async with grpc.aio.insecure_channel(all_services["retrieval"].address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.IndexStatus(
                retrieval_pb2.IndexStatusRequest(),
                timeout=10,
                metadata=(("x-ragline-tenant", "bad tenant!"),),
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "x-ragline-tenant" in caught.value.details()


async def test_run_id_is_echoed_in_trailers(all_services):
    async with grpc.aio.insecure_channel(all_services["embedding"].address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Embed(
                embedding_pb2.EmbedRequest(texts=["hi"], dim=1000),
                timeout=10,
                metadata=(("x-ragline-run-id", "run-123"),),
            )
    assert ("x-ragline-run-id", "run-123") in tuple(caught.value.trailing_metadata())
