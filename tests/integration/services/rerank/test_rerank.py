"""The rerank service as a real process on its real models (late interaction on the
embedding model's token vectors, ragline's trained cross-encoder)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ragline.v1 import rerank_pb2, rerank_pb2_grpc
from ragline_app.datasets import load_squad
from support import SQUAD_SAMPLE, error_info, field_violations
from support.metrics import sample_values, scrape

pytestmark = pytest.mark.integration

ACME = (("x-ragline-tenant", "acme"),)


def candidates(count: int) -> list[rerank_pb2.RerankCandidate]:
    passages, _ = load_squad(SQUAD_SAMPLE)
    return [
        rerank_pb2.RerankCandidate(id=p.id, text=f"{p.title}. {p.text}", first_stage_score=0.0)
        for p in passages[:count]
    ]


async def rerank(
    address: str,
    request: rerank_pb2.RerankRequest,
    deadline_s: float = 60.0,
    tenant: str = "acme",
):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        return await stub.Rerank(
            request, timeout=deadline_s, metadata=(("x-ragline-tenant", tenant),)
        )


async def test_the_cascade_finds_the_passage_that_answers(rerank_pair):
    service, _ = rerank_pair
    pool = candidates(40)
    question = "Which river flows through Warsaw?"
    request = rerank_pb2.RerankRequest(
        query=question, candidates=pool, top_k=3, late_interaction_k=15
    )
    reply = await rerank(service.address, request)
    assert [s for s in reply.stages_run] == [
        rerank_pb2.RERANK_STAGE_LATE_INTERACTION,
        rerank_pb2.RERANK_STAGE_CROSS_ENCODER,
    ]
    assert len(reply.results) == 3 and [r.rank for r in reply.results] == [1, 2, 3]
    assert "Vistula" in {p.id: p.text for p in pool}[reply.results[0].id]
    assert set(reply.results[0].scores) == {"late_interaction", "cross_encoder"}
    assert reply.usage.input_tokens > 0
    assert [s.name for s in reply.timing.stages] == ["late_interaction", "cross_encoder"]


def runs_over(handle, texts: int) -> float:
    """The model runs of the service's batchers that held more than `texts` texts (a
    bucket bound of ragline_batch_texts)."""
    found = scrape(handle.metrics_port)
    runs = sample_values(found, "ragline_batch_texts", "_count")
    within = {
        (s.labels["batcher"], s.labels["lane"]): s.value
        for s in found["ragline_batch_texts"]
        if s.name.endswith("_bucket") and s.labels["le"] == f"{float(texts)}"
    }
    assert runs, "no model run recorded"
    return sum(count - within[key] for key, count in runs.items())


async def test_batched_and_unbatched_scores_are_identical(rerank_pair):
    batched, unbatched = rerank_pair
    pool = candidates(12)
    questions = [
        "Which river flows through Warsaw?",
        "Who were the Normans?",
        "What is computational complexity theory?",
        "Where is Southern California?",
    ]

    async def scores(address):
        replies = await asyncio.gather(
            *(
                rerank(address, rerank_pb2.RerankRequest(query=q, candidates=pool, top_k=12))
                for q in questions
            )
        )
        return [{r.id: dict(r.scores) for r in reply.results} for reply in replies]

    together = await scores(batched.address)
    alone = await scores(unbatched.address)
    # The comparison means something: one service ran the pairs of several requests in one
    # run (more than a request's 12), the other never did (and its model reads one at a time)
    assert runs_over(batched, 16) > 0
    assert runs_over(unbatched, 16) == 0
    for a, b in zip(together, alone, strict=True):
        assert list(a) == list(b)  # the same order
        for pid in a:
            for stage, value in a[pid].items():
                assert abs(value - b[pid][stage]) < 1e-5, (pid, stage)


async def test_stage_two_is_skipped_when_the_deadline_cannot_afford_it(launcher):
    # The cross-encoder reads all 30 candidates: ~150 ms or more even on an idle machine
    # (with 5 it took ~20 ms there and fitted the deadline below), stage one ~15-30 ms.
    service = launcher.start("rerank", env={"RAGLINE_RERANK_CROSS_ENCODER_CANDIDATES": "30"})
    request = rerank_pb2.RerankRequest(
        query="Who were the Normans?", candidates=candidates(30), top_k=5, allow_skip=True
    )
    # One channel, connected before the timed calls: a connection made inside a 60 ms
    # deadline on a loaded machine ran the call out before the service could decide.
    async with grpc.aio.insecure_channel(service.address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        tenant = (("x-ragline-tenant", "acme"),)
        # warm: the service learns what each stage costs
        await stub.Rerank(request, timeout=60, metadata=tenant)
        # 60 ms: room for stage one but not for the cross-encoder (30 ms failed once on a
        # loaded machine: stage one alone).
        reply = await stub.Rerank(request, timeout=0.06, metadata=tenant)
        assert [s.stage for s in reply.skipped] == [rerank_pb2.RERANK_STAGE_CROSS_ENCODER]
        assert reply.skipped[0].reason.startswith("deadline")
        assert reply.skipped[0].cause == rerank_pb2.SKIP_CAUSE_DEADLINE
        assert list(reply.stages_run) == [rerank_pb2.RERANK_STAGE_LATE_INTERACTION]
        strict = rerank_pb2.RerankRequest(
            query="Who were the Normans?", candidates=candidates(30), top_k=5
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Rerank(strict, timeout=0.06, metadata=tenant)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The service's own decision (its ErrorInfo), not the client's timer running out.
    assert error_info(caught.value)[0] == "STAGE_UNAFFORDABLE"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"query": "q"}, "candidates"),
        ({"query": "", "candidates": [{"id": "a", "text": "t"}]}, "query"),
        (
            {"query": "q", "candidates": [{"id": f"c{i}", "text": "t"} for i in range(1001)]},
            "candidates",
        ),
        (
            {"query": "q", "candidates": [{"id": "a", "text": "t"}, {"id": "a", "text": "u"}]},
            "candidates[1].id",
        ),
        ({"query": "q", "candidates": [{"id": "a", "text": ""}]}, "candidates[0].text"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(rerank_pair, fields, field):
    service, _ = rerank_pair
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await rerank(service.address, rerank_pb2.RerankRequest(**fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(caught.value)


async def test_a_query_longer_than_the_cross_encoder_window_still_ranks(rerank_pair):
    service, _ = rerank_pair
    long_query = "Which river flows through Warsaw " + "and its many districts " * 60 + "?"
    request = rerank_pb2.RerankRequest(query=long_query, candidates=candidates(5), top_k=2)
    reply = await rerank(service.address, request)
    assert len(reply.results) == 2


async def test_prepared_documents_cost_a_query_only_their_scoring(rerank_pair):
    service, _ = rerank_pair
    pool = candidates(25)[10:]
    initech = (("x-ragline-tenant", "initech"),)  # a tenant no other test of this module uses
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        documents = [rerank_pb2.PrepareDocument(id=c.id, text=c.text) for c in pool]
        first = await stub.Prepare(
            rerank_pb2.PrepareRequest(documents=documents), timeout=60, metadata=initech
        )
        again = await stub.Prepare(
            rerank_pb2.PrepareRequest(documents=documents), timeout=60, metadata=initech
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Prepare(rerank_pb2.PrepareRequest(), timeout=10, metadata=initech)
    assert (first.prepared, first.already_prepared) == (len(pool), 0)
    assert (again.prepared, again.already_prepared) == (0, len(pool))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "documents" in field_violations(caught.value)
    question = "Who were the Normans?"
    reply = await rerank(
        service.address,
        rerank_pb2.RerankRequest(query=question, candidates=pool, top_k=3),
        tenant="initech",
    )
    # Stage 1 encoded the query alone; the cross-encoder read its pairs.
    pairs = reply.usage.input_tokens
    cold = await rerank(
        service.address,
        rerank_pb2.RerankRequest(query=question, candidates=pool, top_k=3),
        tenant="globex",
    )
    assert cold.usage.input_tokens > pairs + first.usage.input_tokens // 2
    assert [r.id for r in cold.results] == [r.id for r in reply.results]


async def test_a_query_prepared_ahead_is_used_by_its_rerank(rerank_pair):
    service, _ = rerank_pair
    pool = candidates(20)
    hooli = (("x-ragline-tenant", "hooli"),)  # a tenant no other test of this module uses
    question = "When were the Normans in Normandy?"
    request = rerank_pb2.RerankRequest(
        query=question, candidates=pool, top_k=5, late_interaction_only=True
    )
    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        documents = [rerank_pb2.PrepareDocument(id=c.id, text=c.text) for c in pool]
        await stub.Prepare(
            rerank_pb2.PrepareRequest(documents=documents), timeout=60, metadata=hooli
        )
        cold = await stub.Rerank(request, timeout=60, metadata=hooli)  # encodes the query
        ahead = await stub.Prepare(
            rerank_pb2.PrepareRequest(query=question), timeout=60, metadata=hooli
        )
        warm = await stub.Rerank(request, timeout=60, metadata=hooli)
    assert ahead.query_prepared and not ahead.query_already_prepared
    assert ahead.usage.input_tokens > 0 and (ahead.prepared, ahead.already_prepared) == (0, 0)
    # The rerank read nothing: the query was ready and the documents kept.
    assert cold.usage.input_tokens == ahead.usage.input_tokens
    assert warm.usage.input_tokens == 0
    assert [(r.id, r.score) for r in warm.results] == [(r.id, r.score) for r in cold.results]


async def test_prepared_token_vectors_survive_a_restart(launcher, tmp_path):
    env = {"RAGLINE_RERANK_TOKEN_STORE_DIR": str(tmp_path / "tokens")}
    pool = candidates(12)
    documents = [rerank_pb2.PrepareDocument(id=c.id, text=c.text) for c in pool]
    request = rerank_pb2.RerankRequest(
        query="Who ruled the duchy of Normandy?", candidates=pool, late_interaction_only=True
    )
    first = launcher.start("rerank", env=env)
    async with grpc.aio.insecure_channel(first.address) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        prepared = await stub.Prepare(
            rerank_pb2.PrepareRequest(documents=documents), timeout=60, metadata=ACME
        )
        before = await stub.Rerank(request, timeout=60, metadata=ACME)
    first.stop()
    second = launcher.start("rerank", env=env)
    async with grpc.aio.insecure_channel(second.address) as channel:
        stub = rerank_pb2_grpc.RerankServiceStub(channel)
        after = await stub.Rerank(request, timeout=60, metadata=ACME)
        again = await stub.Prepare(
            rerank_pb2.PrepareRequest(documents=documents), timeout=60, metadata=ACME
        )
        other = await stub.Rerank(request, timeout=60, metadata=(("x-ragline-tenant", "umbrella"),))
    assert prepared.prepared == len(pool)
    # Only the query was encoded after the restart: the documents came from the disk.
    assert after.usage.input_tokens == before.usage.input_tokens < prepared.usage.input_tokens
    assert [(r.id, r.score) for r in after.results] == [(r.id, r.score) for r in before.results]
    assert (again.prepared, again.already_prepared) == (0, len(pool))
    assert other.usage.input_tokens > after.usage.input_tokens  # another tenant: encoded


async def test_prepare_returns_the_embedding_the_embedding_service_gives(
    rerank_pair, embedding_service
):
    """One run for both: the embeddings Prepare returns are the embedding service's vectors
    for the same passages (same model, same version), so ingest can skip its Embed call."""
    import numpy as np

    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    batched, _ = rerank_pair
    passages = candidates(12)
    async with grpc.aio.insecure_channel(batched.address) as channel:
        prepared = await rerank_pb2_grpc.RerankServiceStub(channel).Prepare(
            rerank_pb2.PrepareRequest(
                documents=[rerank_pb2.PrepareDocument(id=c.id, text=c.text) for c in passages],
                return_embeddings=True,
            ),
            timeout=60,
            metadata=(("x-ragline-tenant", "embeds"),),
        )
    async with grpc.aio.insecure_channel(embedding_service.address) as channel:
        embedded = await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            embedding_pb2.EmbedRequest(
                texts=[c.text for c in passages], input_type=embedding_pb2.INPUT_TYPE_PASSAGE
            ),
            timeout=60,
            metadata=ACME,
        )
    assert prepared.embedding_model_version == embedded.model_version
    assert prepared.prepared == len(passages)
    ours = np.array([e.values for e in prepared.embeddings], dtype=np.float32)
    theirs = np.array([e.values for e in embedded.embeddings], dtype=np.float32)
    assert ours.shape == theirs.shape == (len(passages), embedded.dim)
    assert np.min(np.sum(ours * theirs, axis=1)) > 0.9999
    assert [e.token_count for e in prepared.embeddings] == [
        e.token_count for e in embedded.embeddings
    ]
