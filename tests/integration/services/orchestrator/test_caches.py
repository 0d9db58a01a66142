"""The orchestrator's answer, retrieval and tool-result caches with every service a real
process: hits that report what they saved, tenants and scopes that never share an entry,
writes and deletes that invalidate, and replicas sharing one real Redis."""

from __future__ import annotations

import uuid

import grpc
import pytest

from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from support.retrieval import Client

pytestmark = pytest.mark.integration

WARSAW = "Which river flows through Warsaw?"
CACHED = orchestrator_pb2.NODE_STATE_CACHED
COMPLETE = common_pb2.ANSWER_STATE_COMPLETE


async def ask(address: str, question: str, tenant: str = "default", scopes: str = "", **fields):
    metadata = [("x-ragline-tenant", tenant)]
    if scopes:
        metadata.append(("x-ragline-scopes", scopes))
    request = orchestrator_pb2.AskRequest(question=question, **fields)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        messages = [m async for m in stub.Ask(request, timeout=120, metadata=tuple(metadata))]
    return messages[-1].result


def node_states(result) -> dict[str, int]:
    return {n.node_id: n.state for n in result.timing.nodes}


async def test_a_repeated_question_is_answered_from_the_cache_with_what_it_saved(rag_stack):
    orchestrator = rag_stack.orchestrator()
    first = await ask(orchestrator.address, WARSAW)
    assert first.status.state == COMPLETE and not first.cache.answer_hit
    again = await ask(orchestrator.address, "  which RIVER flows through warsaw  ")
    assert again.cache.answer_hit
    assert again.answer == first.answer
    assert [c.document_id for c in again.citations] == [c.document_id for c in first.citations]
    assert set(node_states(again).values()) == {CACHED}
    saved = {s.node_id: s for s in again.cache.saved}
    generate = saved["generate"]
    assert generate.layer == "answer" and generate.input_tokens > 0 and generate.output_tokens > 0
    # prefill and decode are reported apart
    assert generate.prefill.ToNanoseconds() > 0 and generate.decode.ToNanoseconds() > 0
    assert again.timing.end_to_end.ToNanoseconds() < first.timing.end_to_end.ToNanoseconds()
    # BYPASS neither reads nor writes
    bypass = await ask(orchestrator.address, WARSAW, cache=orchestrator_pb2.CACHE_POLICY_BYPASS)
    assert not bypass.cache.answer_hit and bypass.cache.retrieval_hits == 0


async def test_a_new_question_reuses_cached_retrievals_and_tool_results(rag_stack):
    orchestrator = rag_stack.orchestrator()
    first = await ask(orchestrator.address, WARSAW, max_tokens=16)
    assert first.cache.retrieval_hits == 0
    # Another answer shape (max_tokens): the answer misses, retrieval and embedding hit.
    second = await ask(orchestrator.address, WARSAW, max_tokens=24)
    assert not second.cache.answer_hit
    assert second.cache.retrieval_hits == 2 and second.cache.tool_hits >= 1
    states = node_states(second)
    assert states["bm25"] == states["vector"] == states["embed"] == CACHED
    assert states["generate"] == orchestrator_pb2.NODE_STATE_SUCCEEDED


async def test_two_tenants_never_share_an_answer_a_retrieval_or_a_tool_result(rag_stack):
    orchestrator = rag_stack.orchestrator()
    tenant = f"other-{uuid.uuid4().hex[:8]}"
    documents = Client(rag_stack.retrieval.address)
    warsaw = "Warsaw stands on the Vistula River in east-central Poland."
    await documents.upsert(tenant, [{"id": "w", "title": "Warsaw", "text": warsaw}])
    await ask(orchestrator.address, WARSAW)
    await ask(orchestrator.address, WARSAW)  # every layer of "default" now holds this
    other = await ask(orchestrator.address, WARSAW, tenant=tenant)
    assert not other.cache.answer_hit
    assert other.cache.retrieval_hits == 0 and other.cache.tool_hits == 0
    assert {c.document_id for c in other.citations} <= {"w"}
    await documents.close()


async def test_a_revoked_scope_stops_the_cached_answer_at_once(rag_stack):
    orchestrator = rag_stack.orchestrator()
    tenant = f"acme-{uuid.uuid4().hex[:8]}"
    documents = Client(rag_stack.retrieval.address)
    await documents.upsert(
        tenant,
        [
            {
                "id": "pay",
                "title": "Pay",
                "text": "The salary band for senior engineers is 90,000 to 120,000 euros.",
                "acl": ["hr"],
            },
            {"id": "canteen", "title": "Canteen", "text": "The canteen opens at eight."},
        ],
    )
    question = "What is the salary band for senior engineers?"
    await ask(orchestrator.address, question, tenant=tenant, scopes="hr")
    hit = await ask(orchestrator.address, question, tenant=tenant, scopes="hr")
    assert hit.cache.answer_hit and "pay" in {c.document_id for c in hit.citations}
    revoked = await ask(orchestrator.address, question, tenant=tenant)  # the scope is gone
    assert not revoked.cache.answer_hit
    assert "pay" not in {c.document_id for c in [*revoked.citations, *revoked.evidence]}
    await documents.close()


async def test_updating_or_deleting_a_cited_document_invalidates_the_answer(rag_stack):
    orchestrator = rag_stack.orchestrator()
    tenant = f"docs-{uuid.uuid4().hex[:8]}"
    documents = Client(rag_stack.retrieval.address)
    text = "The Krakow office opens at 8 am."
    first_write = await documents.upsert(tenant, [{"id": "hours", "text": text}])
    question = "When does the Krakow office open?"
    await ask(orchestrator.address, question, tenant=tenant)
    assert (await ask(orchestrator.address, question, tenant=tenant)).cache.answer_hit
    update = await documents.upsert(
        tenant, [{"id": "hours", "text": "The Krakow office opens at 9 am."}]
    )
    after = await ask(orchestrator.address, question, tenant=tenant)
    assert not after.cache.answer_hit and after.cache.retrieval_hits == 0
    assert update.versions[0] > first_write.versions[0]
    assert {c.version for c in after.evidence} == {update.versions[0]}
    assert (await ask(orchestrator.address, question, tenant=tenant)).cache.answer_hit
    await documents.delete(tenant, ["hours"])
    gone = await ask(orchestrator.address, question, tenant=tenant)
    assert not gone.cache.answer_hit
    assert gone.status.state == common_pb2.ANSWER_STATE_INCOMPLETE  # nothing left to cite
    await documents.close()


async def test_a_second_replica_hits_the_answer_the_first_cached_in_redis(rag_stack, redis_server):
    first = rag_stack.orchestrator(cache_url=redis_server.url)
    second = rag_stack.orchestrator(cache_url=redis_server.url)
    tenant = f"shared-{uuid.uuid4().hex[:8]}"
    documents = Client(rag_stack.retrieval.address)
    await documents.upsert(
        tenant, [{"id": "w", "title": "Warsaw", "text": "Warsaw lies on the Vistula River."}]
    )
    answered = await ask(first.address, WARSAW, tenant=tenant)
    assert answered.status.state == COMPLETE and not answered.cache.answer_hit
    shared = await ask(second.address, WARSAW, tenant=tenant)
    assert shared.cache.answer_hit and shared.answer == answered.answer
    await documents.close()


async def test_a_deleted_documents_text_leaves_redis_at_the_next_sweep(rag_stack, redis_server):
    """RAGLINE_ORCHESTRATOR_CACHE_SWEEP_S: cached answers and retrievals are checked against
    the documents they cite, so a deleted document's text (its snippet in an answer, its
    passage in a retrieval) is in no Redis key after the next sweep, not after the TTL."""
    import asyncio

    import redis.asyncio as redis

    orchestrator = rag_stack.orchestrator(cache_url=redis_server.url, cache_sweep_s=0.5)
    tenant = f"forget-{uuid.uuid4().hex[:8]}"
    documents = Client(rag_stack.retrieval.address)
    secret = "The Gdansk vault code is held by the night porter."
    await documents.upsert(tenant, [{"id": "vault", "title": "Vault", "text": secret}])
    await documents.upsert(tenant, [{"id": "other", "title": "Lunch", "text": "Lunch is at one."}])
    answered = await ask(orchestrator.address, "Who holds the Gdansk vault code?", tenant=tenant)
    assert answered.status.state == COMPLETE

    client = redis.from_url(redis_server.url)

    async def keys_holding(text: bytes) -> list[bytes]:
        found = []
        async for key in client.scan_iter(count=500):
            value = await client.get(key)
            if value and text in value:
                found.append(key)
        return found

    assert await keys_holding(b"Gdansk vault code")  # the answer and the retrieval
    await documents.delete(tenant, ["vault"])
    for _ in range(100):
        if not await keys_holding(b"Gdansk vault code"):
            break
        await asyncio.sleep(0.1)
    assert not await keys_holding(b"Gdansk vault code")
    await client.aclose()
    await documents.close()
