"""The HTTP gateway through a real stack, with the clients agent teams use: the openai SDK
(whole and streamed), LangChain's ChatOpenAI and OpenAIEmbeddings in a retrieval chain, and
curl. An INCOMPLETE answer is a refusal with empty content; errors keep their gRPC meaning
(429 + Retry-After, 504, 400 naming the field); a closed connection cancels the Ask."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import grpc
import httpx
import pytest
from openai import APIStatusError, AsyncOpenAI

from ragline.v1 import embedding_pb2, embedding_pb2_grpc
from support import REPO_ROOT, wait_until
from support.orchestrator import generation_slot_free, who

pytestmark = pytest.mark.integration

WARSAW = "Which river flows through Warsaw?"
UNCOVERED = "What is the capital of Australia?"
LONG_ANSWER = (
    "Describe Warsaw in detail, in at least ten sentences: its river, its history, its "
    "buildings, its parks, its wildlife and its people."
)


BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def gateway(rag_stack):
    orchestrator = rag_stack.orchestrator()
    return rag_stack.launcher.gateway(
        orchestrator,
        rag_stack.embedding,
        rag_stack.retrieval,
        env={"RAGLINE_GATEWAY_MAX_BODY_BYTES": str(BODY_LIMIT)},
    )


@pytest.fixture(scope="module")
def small_gateway(rag_stack):
    """Over an orchestrator of one run at a time, no queue, on the one-slot small model."""
    orchestrator = rag_stack.orchestrator(small=True, max_in_flight=1, max_queue=0)
    return rag_stack.launcher.gateway(orchestrator, rag_stack.embedding, rag_stack.retrieval)


def client(handle) -> AsyncOpenAI:
    # The SDK needs a key; with authentication off the services do not read it.
    return AsyncOpenAI(base_url=f"http://{handle.address}/v1", api_key="unused", max_retries=0)


async def test_openai_sdk_answers_with_citations_and_the_answer_state(gateway):
    completion = await client(gateway).chat.completions.create(
        model="ragline", messages=[{"role": "user", "content": WARSAW}]
    )
    message = completion.choices[0].message
    extension = completion.model_extra["ragline"]
    assert extension["state"] in ("COMPLETE", "PARTIAL"), extension
    assert "vistula" in message.content.lower()
    assert message.refusal is None
    citations = extension["citations"]
    assert citations and all(c["title"] == "Warsaw" for c in citations)
    # The sources as `ragline ask` prints them: markers in the text, then the list.
    assert citations[0]["marker"] in message.content.split("\n")[0]
    assert f"{citations[0]['marker']} Warsaw ({citations[0]['document_id']}" in message.content
    assert completion.usage.prompt_tokens > 0
    assert extension["run_id"] and completion.id == f"chatcmpl-{extension['run_id']}"


async def test_openai_sdk_streams_the_draft_then_the_answer_and_its_state(gateway):
    stream = await client(gateway).chat.completions.create(
        model="ragline", messages=[{"role": "user", "content": WARSAW}], stream=True
    )
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    drafts = "".join((c.model_extra.get("ragline") or {}).get("draft_delta", "") for c in chunks)
    assert "vistula" in content.lower()
    assert "vistula" in drafts.lower()  # the text as it was written, beside the content
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop"
    assert last.model_extra["ragline"]["state"] in ("COMPLETE", "PARTIAL")
    assert last.model_extra["ragline"]["citations"]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_incomplete_answer_has_empty_content_and_its_reason_as_refusal(gateway, stream):
    messages = [{"role": "user", "content": UNCOVERED}]
    openai = client(gateway)
    if stream:
        chunks = [
            c
            async for c in await openai.chat.completions.create(
                model="ragline", messages=messages, stream=True
            )
        ]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        refusal = "".join((c.choices[0].delta.refusal or "") for c in chunks if c.choices)
        extension = chunks[-1].model_extra["ragline"]
    else:
        completion = await openai.chat.completions.create(model="ragline", messages=messages)
        content = completion.choices[0].message.content or ""
        refusal = completion.choices[0].message.refusal
        extension = completion.model_extra["ragline"]
    assert content == ""
    assert extension["state"] == "INCOMPLETE"
    assert extension["reason"] == "no_relevant_evidence"
    assert refusal.startswith("INCOMPLETE (no_relevant_evidence)")


def test_langchain_retrieval_chain_answers_with_citations_and_refuses_as_langchain_shows_it(
    gateway,
):
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import RunnableLambda
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    base_url = f"http://{gateway.address}/v1"
    # No tokenizer download: the gateway's embedding service counts its own tokens.
    embeddings = OpenAIEmbeddings(
        model="ragline", base_url=base_url, api_key="unused", check_embedding_ctx_length=False
    )
    store = InMemoryVectorStore.from_documents(
        [
            Document(page_content="Warsaw is the capital of Poland.", metadata={"topic": "city"}),
            Document(page_content="Rivers carry water to the sea.", metadata={"topic": "river"}),
        ],
        embeddings,
    )
    found = store.as_retriever(search_kwargs={"k": 1}).invoke("the Polish capital")
    assert found[0].metadata["topic"] == "city"

    llm = ChatOpenAI(model="ragline", base_url=base_url, api_key="unused", max_retries=0)
    # The agent's own chain: its retriever picks the subject, ragline answers from its
    # documents.
    chain = (
        store.as_retriever(search_kwargs={"k": 1})
        | RunnableLambda(lambda docs: f"Which river flows through {docs[0].page_content[:6]}?")
        | llm
    )
    answer = chain.invoke("the Polish capital")
    assert "vistula" in answer.content.lower()
    assert "[1]" in answer.content and "sources:" in answer.content
    assert (llm | StrOutputParser()).invoke(WARSAW)  # a plain string for a plain chain

    refused = llm.invoke(UNCOVERED)
    assert refused.content == ""
    assert refused.additional_kwargs["refusal"].startswith("INCOMPLETE (no_relevant_evidence)")


async def test_embeddings_equal_the_grpc_embed_vectors(gateway, rag_stack):
    texts = [WARSAW, "The Vistula flows through Warsaw."]
    async with httpx.AsyncClient(base_url=f"http://{gateway.address}") as http:
        for input_type, proto_type in (
            ("query", embedding_pb2.INPUT_TYPE_QUERY),
            ("passage", embedding_pb2.INPUT_TYPE_PASSAGE),
        ):
            reply = await http.post(
                "/v1/embeddings",
                json={"input": texts, "model": "ragline", "ragline": {"input_type": input_type}},
            )
            assert reply.status_code == 200, reply.text
            served = [d["embedding"] for d in reply.json()["data"]]
            async with grpc.aio.insecure_channel(rag_stack.embedding.address) as channel:
                direct = await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
                    embedding_pb2.EmbedRequest(texts=texts, input_type=proto_type),
                    timeout=30,
                    metadata=who(),
                )
            assert served == [list(e.values) for e in direct.embeddings]
    assert served[0] != served[1]


async def test_a_full_orchestrator_is_429_with_retry_after(small_gateway):
    async with httpx.AsyncClient(base_url=f"http://{small_gateway.address}", timeout=60) as http:
        body = {
            "model": "ragline",
            "messages": [{"role": "user", "content": LONG_ANSWER}],
            "stream": True,
            "max_tokens": 2000,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as running:
            assert running.status_code == 200  # admitted: it holds the only place
            refused = await http.post(
                "/v1/chat/completions",
                json={"model": "ragline", "messages": [{"role": "user", "content": WARSAW}]},
            )
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "QUEUE_FULL" and error["type"] == "rate_limit_error"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_closed_connection_cancels_the_ask_and_frees_the_generation_slot(
    small_gateway, rag_stack, stream
):
    body = {
        "model": "ragline",
        "messages": [{"role": "user", "content": LONG_ANSWER}],
        "max_tokens": 2000,
        "stream": stream,
        "ragline": {"cache": "bypass"},
    }
    generation = rag_stack.small_generation.address
    async with httpx.AsyncClient(base_url=f"http://{small_gateway.address}", timeout=60) as http:
        if stream:
            async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if "draft_delta" in line:
                        break  # generating: hang up mid-answer
        else:
            # Until the model holds the slot (busy), then hang up.
            call = await _generating(http, body, generation)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
    # The long answer takes several seconds uncut; the cancel frees the slot at once.
    assert await wait_until(lambda: generation_slot_free(generation), timeout_s=1.5)


async def _busy(address: str) -> bool:
    return not await generation_slot_free(address)


async def _answered_or_busy(call: asyncio.Task, generation: str) -> bool:
    return call.done() or await _busy(generation)


async def _generating(http: httpx.AsyncClient, body: dict, generation: str) -> asyncio.Task:
    """The request under way once the model holds the slot for it. Sent again while it is
    refused at once (429): the run before it, hung up on, may hold the orchestrator's one
    place a moment after it freed the slot."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        call = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        left = max(deadline - time.monotonic(), 0.1)
        if not await wait_until(
            lambda call=call: _answered_or_busy(call, generation), timeout_s=left
        ):
            call.cancel()
            break
        if not call.done():
            return call  # the model holds the slot for it
        assert call.result().status_code == 429, call.result().text
        await asyncio.sleep(0.2)
    raise AssertionError("the answer never reached generation")


async def test_errors_keep_their_grpc_meaning(gateway):
    openai = client(gateway)
    with pytest.raises(APIStatusError) as caught:
        await openai.chat.completions.create(
            model="ragline", messages=[{"role": "user", "content": WARSAW}], n=2
        )
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "n"
    with pytest.raises(APIStatusError) as caught:
        await openai.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": WARSAW}]
        )
    assert caught.value.status_code == 404 and caught.value.body["code"] == "model_not_found"
    async with httpx.AsyncClient(base_url=f"http://{gateway.address}", timeout=30) as http:
        late = await http.post(
            "/v1/chat/completions",
            json={
                "model": "ragline",
                "messages": [{"role": "user", "content": LONG_ANSWER}],
                "ragline": {"cache": "bypass"},
            },
            headers={"X-Ragline-Timeout": "0.02"},
        )
        assert late.status_code == 504, late.text
        assert late.json()["error"]["status"] == "DEADLINE_EXCEEDED"
        empty = await http.post("/v1/search", json={"query": "", "k": 5})
        assert empty.status_code == 400
        assert empty.json()["error"]["param"] == "query"
        missing = await http.post("/v1/chat/completions", json={"model": "ragline"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
        # Refused before it is parsed (a body too large for the kernel's socket buffers is
        # cut off while it is sent: the client sees a reset instead of the 413).
        huge = await http.post("/v1/documents", content=b"x" * (BODY_LIMIT + 1))
        assert huge.status_code == 413
        assert huge.json()["error"]["code"] == "REQUEST_TOO_LARGE"


async def test_a_follow_up_is_read_with_the_subject_of_the_turn_before(gateway):
    completion = await client(gateway).chat.completions.create(
        model="ragline",
        messages=[
            {"role": "user", "content": "Tell me about Warsaw."},
            {"role": "assistant", "content": "Warsaw is the capital of Poland."},
            {"role": "user", "content": "Which river flows through it?"},
        ],
        extra_body={"ragline": {"cache": "bypass"}},
    )
    extension = completion.model_extra["ragline"]
    assert "vistula" in (completion.choices[0].message.content or "").lower(), extension
    assert "follow-up read with (Warsaw)" in extension["route_detail"]


def test_curl_writes_and_searches_documents_and_asks_in_json(gateway):
    base = f"http://{gateway.address}"

    def curl(path: str, body: dict) -> dict:
        out = subprocess.run(
            [
                "curl",
                "-sS",
                "--fail-with-body",
                "-H",
                "Content-Type: application/json",
                "-H",
                "X-Ragline-Tenant: curl-tenant",
                "-H",
                "X-Ragline-Scopes: ragline:write",
                "-d",
                json.dumps(body),
                base + path,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(out.stdout)

    written = curl(
        "/v1/documents",
        {"documents": [{"id": "kettle", "title": "Kettle", "text": "The kettle boils at noon."}]},
    )
    assert written["upserted"] == 1
    hits = curl("/v1/search", {"query": "When does the kettle boil?", "k": 3})["hits"]
    assert [h["id"] for h in hits] == ["kettle"]  # this tenant's index only
    deleted = curl("/v1/documents:delete", {"ids": ["kettle"]})
    assert deleted["deleted"] == 1
    asked = curl("/v1/ask", {"question": WARSAW})
    assert asked["status"]["state"] == "ANSWER_STATE_INCOMPLETE"  # curl-tenant has no Warsaw


async def test_the_openapi_file_is_the_served_routes(gateway):
    committed = json.loads((REPO_ROOT / "docs" / "openapi.json").read_text())
    async with httpx.AsyncClient(base_url=f"http://{gateway.address}", timeout=30) as http:
        served = (await http.get("/openapi.json")).json()
        assert served == committed, "docs/openapi.json is stale: run `ragline openapi`"
        for path, operations in committed["paths"].items():
            for method in operations:
                reply = await http.request(method.upper(), path, content=b"{}")
                assert reply.status_code not in (404, 405), (path, method)
