"""Talking to the retrieval service in tests."""

from __future__ import annotations

import grpc

from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc

MODES = {
    "bm25": retrieval_pb2.SEARCH_MODE_BM25,
    "vector": retrieval_pb2.SEARCH_MODE_VECTOR,
    "hybrid": retrieval_pb2.SEARCH_MODE_HYBRID,
    "prefilter": retrieval_pb2.SEARCH_MODE_PREFILTER,
}


def who(tenant: str, scopes: str = "", operator: bool = False) -> tuple[tuple[str, str], ...]:
    metadata = [("x-ragline-tenant", tenant)]
    if scopes:
        metadata.append(("x-ragline-scopes", scopes))
    if operator:
        metadata.append(("x-ragline-operator", "true"))
    return tuple(metadata)


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = retrieval_pb2_grpc.RetrievalServiceStub(self.channel)

    async def upsert(self, tenant, docs, scopes=""):
        request = retrieval_pb2.UpsertRequest()
        for doc in docs:
            request.documents.add(**doc)
        return await self.stub.Upsert(request, timeout=60, metadata=who(tenant, scopes))

    async def search(self, tenant, query, mode="hybrid", k=5, scopes="", **kwargs):
        request = retrieval_pb2.SearchRequest(query=query, k=k, mode=MODES[mode], **kwargs)
        return await self.stub.Search(request, timeout=30, metadata=who(tenant, scopes))

    async def status(self, tenant, operator: bool = False):
        return await self.stub.IndexStatus(
            retrieval_pb2.IndexStatusRequest(), timeout=10, metadata=who(tenant, operator=operator)
        )

    async def versions(self, tenant, ids, scopes=""):
        request = retrieval_pb2.DocumentVersionsRequest(ids=ids)
        return await self.stub.DocumentVersions(request, timeout=10, metadata=who(tenant, scopes))

    async def delete(self, tenant, ids):
        request = retrieval_pb2.DeleteRequest(ids=ids)
        return await self.stub.Delete(request, timeout=30, metadata=who(tenant))

    async def close(self):
        await self.channel.close()
