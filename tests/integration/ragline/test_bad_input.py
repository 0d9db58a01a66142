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
from support import error_info, field_violations

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


@pytest.mark.parametrize(
    ("service", "stub", "method", "message", "field"),
    [
        ("embedding", "EmbeddingServiceStub", "Embed", "EmbedRequest", "texts"),
        ("retrieval", "RetrievalServiceStub", "Search", "SearchRequest", "query"),
        ("rerank", "RerankServiceStub", "Rerank", "RerankRequest", "query"),
        ("generation", "GenerationServiceStub", "CountTokens", "CountTokensRequest", "input"),
        ("budget", "BudgetServiceStub", "GetLedger", "GetLedgerRequest", "task_id"),
        ("orchestrator", "OrchestratorServiceStub", "Ask", "AskRequest", "question"),
    ],
)
async def test_every_service_names_the_field_and_a_stable_reason(
    all_services, service, stub, method, message, field
):
    import importlib

    messages = importlib.import_module(f"ragline.v1.{service}_pb2")
    stubs = importlib.import_module(f"ragline.v1.{service}_pb2_grpc")
    async with grpc.aio.insecure_channel(all_services[service].address) as channel:
        call = getattr(getattr(stubs, stub)(channel), method)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            reply = call(getattr(messages, message)(), timeout=30, metadata=TENANT)
            if hasattr(reply, "__aiter__"):
                async for _ in reply:
                    pass
            else:
                await reply
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(caught.value), field_violations(caught.value)
    reason, domain, metadata = error_info(caught.value)
    assert (reason, domain) == ("INVALID_ARGUMENT", "ragline.dev") and metadata["field"]
