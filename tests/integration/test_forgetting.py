"""A deleted document leaves every store (docs/security.md, "What is kept, and what a
delete reaches"): every service a real process over one data directory and one real Redis,
a document ingested (rerank prepares its token vectors), asked about (the orchestrator
caches the answer and the retrieval, generation saves the prompt's KV state), deleted; then
the write log is compacted, the caches swept, rerank and generation told, and its text is
in no file under the data directory and in no Redis key."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis.asyncio as redis

from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from ragline_app.ingest import Checkpoint, ingest
from support.budget import budget_env
from support.retrieval import Client

pytestmark = pytest.mark.integration

SECRET = "The Gdansk vault code is held by the night porter, Marek Zielinski."
OTHERS = [
    ("lunch", "Lunch", "Lunch in the Gdansk office is served at one in the canteen."),
    ("parking", "Parking", "Parking spaces in Gdansk are assigned by the facilities team."),
]


@pytest.fixture(scope="module")
def forgetting_stack(tmp_path_factory, etcd, redis_server, module_launcher):
    data = tmp_path_factory.mktemp("forgetting-data")
    start = module_launcher.start
    common = {"RAGLINE_DATA_DIR": str(data)}
    embedding = start("embedding", env=common)
    rerank = start("rerank", env=common)
    generation = start(
        "generation",
        env={
            **common,
            "RAGLINE_GENERATION_CACHE_URL": redis_server.url,
            "RAGLINE_GENERATION_KV_STORE_HOT_AFTER": "1",
        },
    )
    retrieval = start(
        "retrieval",
        env={
            **common,
            "RAGLINE_EMBEDDING_ADDR": embedding.address,
            "RAGLINE_RERANK_ADDR": rerank.address,
            "RAGLINE_GENERATION_ADDR": generation.address,
            # Compacted half a second after a delete (the default waits an hour).
            "RAGLINE_RETRIEVAL_FORGET_AFTER_S": "0.5",
            "RAGLINE_RETRIEVAL_BUILD_CHECK_S": "0.2",
        },
    )
    budget = start("budget", env={**common, **budget_env(etcd)})
    parts = {
        "embedding": embedding,
        "retrieval": retrieval,
        "rerank": rerank,
        "generation": generation,
        "budget": budget,
    }
    orchestrator = start(
        "orchestrator",
        env={
            **common,
            **{f"RAGLINE_{name.upper()}_ADDR": part.address for name, part in parts.items()},
            "RAGLINE_ORCHESTRATOR_CACHE_URL": redis_server.url,
            "RAGLINE_ORCHESTRATOR_CACHE_SWEEP_S": "0.5",
        },
    )
    return data, parts, orchestrator


async def ask(address: str, question: str, tenant: str, cache) -> common_pb2.AnswerStatus:
    request = orchestrator_pb2.AskRequest(question=question, cache=cache)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        messages = [
            m
            async for m in stub.Ask(request, timeout=120, metadata=(("x-ragline-tenant", tenant),))
        ]
    return messages[-1].result


def files_holding(directory: Path, text: bytes) -> list[str]:
    found = []
    for path in directory.rglob("*"):
        try:
            if path.is_file() and text in path.read_bytes():
                found.append(str(path.relative_to(directory)))
        except FileNotFoundError:
            continue  # removed between the listing and the read (an index swap)
    return sorted(found)


def token_rows(directory: Path, tenant: str, doc_id: str) -> int:
    rows = 0
    for path in (directory / "rerank").glob("tokens-*.sqlite"):
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            (count,) = db.execute(
                "SELECT COUNT(*) FROM tokens WHERE tenant = ? AND id = ?", (tenant, doc_id)
            ).fetchone()
            rows += count
    return rows


async def keys_holding(client, text: bytes) -> list[bytes]:
    found = []
    async for key in client.scan_iter(count=500):
        if (await client.type(key)) == b"string" and text in (await client.get(key) or b""):
            found.append(key)
    return found


async def eventually(check, timeout_s: float, what: str):
    give_up = time.monotonic() + timeout_s
    while True:
        found = await check()
        if not found or time.monotonic() > give_up:
            assert not found, f"{what}: {found}"
            return
        await asyncio.sleep(0.25)


async def test_a_deleted_documents_text_is_in_no_file_and_no_redis_key(
    forgetting_stack, redis_server, tmp_path
):
    data, parts, orchestrator = forgetting_stack
    tenant = f"forget-{uuid.uuid4().hex[:8]}"
    corpus = tmp_path / "docs.jsonl"
    records = [("vault", "Vault", SECRET), *OTHERS]
    corpus.write_text(
        "".join(json.dumps({"id": i, "title": t, "text": x}) + "\n" for i, t, x in records)
    )
    await ingest(
        corpus,
        retrieval_addr=parts["retrieval"].address,
        embedding_addr=parts["embedding"].address,
        default_tenant=tenant,
        checkpoint=Checkpoint(tmp_path / "checkpoint.json"),
        rerank_addr=parts["rerank"].address,
    )
    question = "Who holds the Gdansk vault code?"
    for cache in (orchestrator_pb2.CACHE_POLICY_UNSPECIFIED, orchestrator_pb2.CACHE_POLICY_BYPASS):
        result = await ask(orchestrator.address, question, tenant, cache)
        assert result.status.state == common_pb2.ANSWER_STATE_COMPLETE, result.status
    marker = b"Gdansk vault code is held"
    client = redis.from_url(redis_server.url)
    kv_dir = data / "kv-store"
    states_before = {p.name for p in kv_dir.glob("*.bin")}
    # Everything the checks below look at holds the text (or its vectors) before the delete.
    assert files_holding(data, marker)  # the write log, the BM25 segments
    assert await keys_holding(client, marker)  # the cached answer and retrieval
    assert token_rows(data, tenant, "vault")  # rerank's token vectors
    assert states_before  # generation's saved KV states of the prompt quoting it

    documents = Client(parts["retrieval"].address)
    await documents.delete(tenant, ["vault"])

    async def in_files():
        return files_holding(data, marker)

    async def in_redis():
        return await keys_holding(client, marker)

    async def in_token_store():
        return token_rows(data, tenant, "vault")

    async def kv_states():
        return sorted(states_before & {p.name for p in kv_dir.glob("*.bin")})

    await eventually(in_files, 30, "files under the data directory holding the text")
    await eventually(in_redis, 30, "Redis keys holding the text")
    await eventually(in_token_store, 30, "rerank token vectors of the deleted document")
    await eventually(kv_states, 30, "KV states saved from prompts quoting it")
    await client.aclose()
    # The other documents are untouched.
    found = await documents.search(tenant, "Who assigns parking spaces?", mode="bm25")
    assert [hit.id for hit in found.hits][:1] == ["parking"]
    await documents.close()


async def test_forget_calls_need_the_write_scope(forgetting_stack):
    """A caller who may not write cannot make rerank or generation drop a tenant's copies
    (only a cost, but still the tenant's writers' decision)."""
    from ragline.v1 import generation_pb2, generation_pb2_grpc, rerank_pb2, rerank_pb2_grpc
    from support import error_info

    _, parts, _ = forgetting_stack
    reader = (("x-ragline-tenant", "acme"), ("x-ragline-scopes", "public"))
    calls = [
        (
            parts["rerank"],
            rerank_pb2_grpc.RerankServiceStub,
            "ForgetDocuments",
            rerank_pb2.ForgetDocumentsRequest(ids=["a"]),
        ),
        (
            parts["generation"],
            generation_pb2_grpc.GenerationServiceStub,
            "ForgetSources",
            generation_pb2.ForgetSourcesRequest(sources=["a"]),
        ),
    ]
    for part, stub_class, method, request in calls:
        async with grpc.aio.insecure_channel(part.address) as channel:
            call = getattr(stub_class(channel), method)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(request, timeout=10, metadata=reader)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert error_info(caught.value)[0] == "WRITE_SCOPE_NOT_HELD"
            writer = (*reader[:1], ("x-ragline-scopes", "ragline:write"))
            assert (await call(request, timeout=10, metadata=writer)).forgotten == 0
