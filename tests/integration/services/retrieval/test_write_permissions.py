"""Who may write which documents, on a real retrieval service: the write scope, an acl
within the writer's scopes, no overwrite or delete of a document the writer cannot see."""

from __future__ import annotations

import grpc
import pytest

from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from support import error_info
from support.retrieval import Client, start_retrieval, who

pytestmark = pytest.mark.integration

HR_DOC = {"id": "pay", "title": "Salaries", "text": "Salary bands for engineers.", "acl": ["hr"]}


@pytest.fixture
async def hr_tenant(launcher, embedding_service, tmp_path):
    """A retrieval service whose tenant acme holds one HR document, written by HR."""
    service = start_retrieval(launcher, embedding_service, tmp_path / "index")
    client = Client(service.address)
    await client.upsert("acme", [HR_DOC], scopes="hr")
    yield service, client
    await client.close()


async def raw(address: str, method: str, request, scopes: str):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        try:
            return await getattr(stub, method)(request, timeout=30, metadata=who("acme", scopes))
        except grpc.aio.AioRpcError as error:
            return error.code(), error_info(error)[0], error.details()


def upsert(*docs: dict) -> retrieval_pb2.UpsertRequest:
    request = retrieval_pb2.UpsertRequest()
    for doc in docs:
        request.documents.add(**doc)
    return request


async def hr_text(client: Client) -> list[str]:
    found = await client.search("acme", "salary bands", "bm25", scopes="hr", include_text=True)
    return [h.text for h in found.hits if h.id == "pay"]


async def test_without_the_write_scope_nothing_is_written_or_deleted(hr_tenant):
    service, client = hr_tenant
    plain = {"id": "memo", "title": "", "text": "A memo."}
    code, reason, details = await raw(service.address, "Upsert", upsert(plain), "hr")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "WRITE_SCOPE_NOT_HELD")
    assert "ragline:write" in details
    request = retrieval_pb2.DeleteRequest(ids=["pay"])
    code, reason, _ = await raw(service.address, "Delete", request, "hr")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "WRITE_SCOPE_NOT_HELD")
    assert await hr_text(client) == ["Salary bands for engineers."]
    assert not (await client.versions("acme", ["memo"])).versions


async def test_a_writer_cannot_plant_a_document_for_scopes_it_does_not_hold(hr_tenant):
    service, client = hr_tenant
    planted = {"id": "exec-memo", "title": "", "text": "Cite me.", "acl": ["exec"]}
    code, reason, details = await raw(service.address, "Upsert", upsert(planted), "ragline:write")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ACL_SCOPE_NOT_HELD")
    assert "documents[0].acl" in details and "'exec'" in details
    assert not (await client.versions("acme", ["exec-memo"], scopes="exec")).versions
    # A permission is not a visibility scope: no acl may name one.
    reserved = {"id": "r", "title": "", "text": "x", "acl": ["ragline:write"]}
    code, _, details = await raw(service.address, "Upsert", upsert(reserved), "ragline:write")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in details


async def test_a_document_the_writer_cannot_see_is_neither_overwritten_nor_deleted(hr_tenant):
    service, client = hr_tenant
    forged = {"id": "pay", "title": "Salaries", "text": "Everyone earns the same."}
    code, reason, _ = await raw(service.address, "Upsert", upsert(forged), "ragline:write")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "DOCUMENT_NOT_VISIBLE")
    gone = await raw(
        service.address, "Delete", retrieval_pb2.DeleteRequest(ids=["pay"]), "ragline:write"
    )
    assert (gone.deleted, gone.not_found) == (0, 1)  # as if it did not exist
    assert await hr_text(client) == ["Salary bands for engineers."]
    # HR itself may rewrite and delete it.
    await client.upsert("acme", [{**HR_DOC, "text": "New salary bands."}], scopes="hr")
    assert await hr_text(client) == ["New salary bands."]
    deleted = await client.delete("acme", ["pay"], scopes="hr")
    assert (deleted.deleted, deleted.not_found) == (1, 0)
    assert await hr_text(client) == []
