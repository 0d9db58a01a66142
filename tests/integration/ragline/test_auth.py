"""Authentication between real processes: client tokens at the service a client calls, the
service credential on the hop to the next (retrieval -> embedding)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragline.auth import mint_token
from ragline.v1 import embedding_pb2, embedding_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from support import AUTH_CLIENT_KEY, error_info

pytestmark = pytest.mark.integration


def token(tenant: str, *scopes: str) -> str:
    return mint_token(AUTH_CLIENT_KEY, tenant, principal="ana", scopes=scopes)


def bearer(tenant: str, *scopes: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token(tenant, *scopes)}"),)


async def call(address: str, method: str, request, metadata=()):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        return await getattr(stub, method)(request, timeout=30, metadata=metadata)


async def code_of(coroutine) -> tuple[grpc.StatusCode, str]:
    """The status code of a refused call and its ErrorInfo reason."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await coroutine
    return caught.value.code(), error_info(caught.value)[0]


async def test_tokens_decide_tenant_and_scopes_and_services_vouch_for_each_other(
    authenticated_stack,
):
    _, retrieval = authenticated_stack
    async with grpc.aio.insecure_channel(retrieval.address) as channel:  # probes need no token
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    documents = retrieval_pb2.UpsertRequest()
    documents.documents.add(id="river", title="Warsaw", text="The Vistula flows through Warsaw.")
    documents.documents.add(
        id="pay", title="Salaries", text="Salary bands of the Warsaw office.", acl=["hr"]
    )
    # Writing takes the write scope, and an acl only names scopes the writer holds.
    assert await code_of(call(retrieval.address, "Upsert", documents, bearer("acme", "hr"))) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "WRITE_SCOPE_NOT_HELD",
    )
    assert await code_of(
        call(retrieval.address, "Upsert", documents, bearer("acme", "ragline:write"))
    ) == (grpc.StatusCode.PERMISSION_DENIED, "ACL_SCOPE_NOT_HELD")
    # The documents are embedded through the embedding service: that hop carries the
    # service credential (the embedding service refuses anything else).
    await call(retrieval.address, "Upsert", documents, bearer("acme", "hr", "ragline:write"))

    search = retrieval_pb2.SearchRequest(query="Warsaw", k=5, mode=retrieval_pb2.SEARCH_MODE_HYBRID)
    forged = (("x-ragline-tenant", "acme"), ("x-ragline-scopes", "hr"))
    refused = (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert await code_of(call(retrieval.address, "Search", search, forged)) == refused
    assert await code_of(call(retrieval.address, "Search", search)) == refused
    wrong_key = (("authorization", f"Bearer {mint_token('k' * 40, 'acme', scopes=['hr'])}"),)
    assert await code_of(call(retrieval.address, "Search", search, wrong_key)) == refused
    expired = (
        ("authorization", f"Bearer {mint_token(AUTH_CLIENT_KEY, 'acme', ttl_s=-120)}"),
    )  # past the 30 s leeway
    assert await code_of(call(retrieval.address, "Search", search, expired)) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "TOKEN_EXPIRED",
    )
    # A token that would live for a year: a leaked one would be a key.
    forever = (
        ("authorization", f"Bearer {mint_token(AUTH_CLIENT_KEY, 'acme', ttl_s=365 * 86400)}"),
    )
    assert await code_of(call(retrieval.address, "Search", search, forever)) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "TOKEN_LIFETIME",
    )
    asks_more = (*bearer("acme"), ("x-ragline-scopes", "hr"))
    assert await code_of(call(retrieval.address, "Search", search, asks_more)) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "SCOPE_NOT_HELD",
    )
    other_tenant = (*bearer("acme"), ("x-ragline-tenant", "globex"))
    assert await code_of(call(retrieval.address, "Search", search, other_tenant)) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "TENANT_MISMATCH",
    )

    plain = await call(retrieval.address, "Search", search, bearer("acme"))
    assert [h.id for h in plain.hits] == ["river"]
    assert not plain.fell_back, plain.fallback_reason  # the query embedding hop was accepted
    with_hr = await call(retrieval.address, "Search", search, bearer("acme", "hr"))
    assert {h.id for h in with_hr.hits} == {"river", "pay"}
    assert not (await call(retrieval.address, "Search", search, bearer("globex"))).hits


async def test_an_inner_service_refuses_calls_without_the_service_credential(
    authenticated_stack,
):
    embedding, _ = authenticated_stack
    request = embedding_pb2.EmbedRequest(texts=["Warsaw"])
    async with grpc.aio.insecure_channel(embedding.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        for metadata in (
            (("x-ragline-tenant", "acme"),),
            (("x-ragline-service-credential", token("acme")), ("x-ragline-tenant", "acme")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Embed(request, timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await stub.Embed(request, timeout=30, metadata=bearer("acme"))
    assert len(reply.embeddings) == 1


def test_a_service_with_auth_off_refuses_to_listen_beyond_loopback(tmp_path):
    """`ragline serve --host 0.0.0.0` with authentication off would let anyone on the
    network claim any tenant: the process refuses to start and says what to do."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAGLINE_AUTH_MODE": "off", "RAGLINE_DATA_DIR": str(tmp_path)}
    ran = subprocess.run(
        [sys.executable, "-m", "ragline_app.cli", "serve", "embedding", "--host", "0.0.0.0",
         "--port", "0"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "is not a loopback address" in ran.stderr
    assert "RAGLINE_AUTH_TRUSTED_NETWORK=true" in ran.stderr
