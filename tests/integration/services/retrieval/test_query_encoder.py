"""The retrieval service embeds query text in process when its model store holds the model
the embedding service runs: same vectors, no hop, and the embedding service is still asked
which model it runs."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from ragline.v1 import embedding_pb2, embedding_pb2_grpc, retrieval_pb2
from support.retrieval import OTHER_MODEL, Client, squad_docs, start_retrieval

pytestmark = pytest.mark.integration


def wait_for_log(handle, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in handle.log():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{handle.log()[-3000:]}"
        time.sleep(0.1)


def stop(launcher, handle) -> None:
    launcher.forget(handle)
    assert handle.stop() == 0


async def service_vector(address: str, text: str) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            embedding_pb2.EmbedRequest(
                texts=[text], input_type=embedding_pb2.INPUT_TYPE_QUERY, dim=384
            ),
            timeout=30,
        )
    return list(reply.embeddings[0].values)


@pytest.mark.parametrize("local", [True, False], ids=["local encoder", "service only"])
async def test_query_text_is_embedded_in_process_with_the_services_model(launcher, tmp_path, local):
    embedding = launcher.start("embedding")
    service = start_retrieval(
        launcher, embedding, tmp_path / "index", local_query_encoder=str(local).lower()
    )
    client = Client(service.address)
    docs, questions = squad_docs(20)
    await client.upsert("acme", docs)
    if local:
        wait_for_log(service, "retrieval.local_query_encoder_on")
    question = questions[0].text
    by_text = await client.search("acme", question, "vector", k=5)
    by_vector = await client.search(
        "acme",
        question,
        "vector",
        k=5,
        query_vector=await service_vector(embedding.address, question),
    )
    # The vectors made here are the embedding service's: same hits, same scores.
    assert [h.id for h in by_text.hits] == [h.id for h in by_vector.hits]
    for mine, theirs in zip(by_text.hits, by_vector.hits, strict=True):
        assert abs(mine.score - theirs.score) < 1e-4
    assert by_text.embedding_model_version == by_vector.embedding_model_version

    stop(launcher, embedding)
    result = await client.search("acme", question, "hybrid")
    if local:  # no hop to the embedding service: it is not needed to search
        assert not result.fell_back and result.mode_used == retrieval_pb2.SEARCH_MODE_HYBRID
        assert result.hits[0].id == questions[0].passage_id
        assert [s.name for s in result.timing.stages][:1] == ["embed"]
    else:
        assert result.fell_back and result.fallback_reason == "embedding_unavailable"
    await client.close()


async def test_a_change_of_the_services_model_is_noticed_without_a_request(launcher, tmp_path):
    embedding = launcher.start("embedding")
    service = start_retrieval(launcher, embedding, tmp_path / "index", embedding_check_s="0.5")
    client = Client(service.address)
    docs, _ = squad_docs(10)
    await client.upsert("acme", docs)
    made_by = (await client.status("acme")).embedding_model_version
    wait_for_log(service, "retrieval.local_query_encoder_on")
    stop(launcher, embedding)
    launcher.start("embedding", env={"RAGLINE_EMBEDDING_MODEL": OTHER_MODEL}, port=embedding.port)
    # No search and no write: only the service's own check can hear the new model, and it
    # re-embeds the index with it as a query or a write would have made it do.
    for _ in range(300):
        status = await client.status("acme")
        if status.embedding_model_version != made_by and not status.reembedding_to:
            break
        await asyncio.sleep(0.1)
    assert status.embedding_model_version.startswith(f"{OTHER_MODEL}@"), status
    assert not status.reembedding_to and status.tenant_documents == 10
    # Now the new model's vectors: embedded here again once it is loaded.
    wait_for_log(service, f"{OTHER_MODEL}@")
    result = await client.search("acme", docs[0]["title"], "hybrid")
    assert not result.fell_back and result.embedding_model_version == status.embedding_model_version
    await client.close()


def test_beside_a_running_embedding_service_the_encoder_is_loaded_before_serving(
    launcher, tmp_path
):
    """Loading the encoder parses its tokenizer with the GIL held (seconds on a busy
    machine): done while serving, it stalled every call in flight after a restart."""
    embedding = launcher.start("embedding")
    service = start_retrieval(launcher, embedding, tmp_path / "index")
    log = service.log()
    assert "retrieval.local_query_encoder_on" in log, log[-3000:]
    assert log.index("retrieval.local_query_encoder_on") < log.index('"service.ready"'), log[-3000:]
