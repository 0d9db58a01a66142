"""Traces across the whole stack (ragline.tracing): every process of a real stack exports its
spans to one file; one Ask is one trace whose spans come from all six services, every
parent is a span of the same trace, the plan nodes' spans agree with the timing report,
and the trace id comes back in the trailers, the report and the log lines."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from ragline.tracing import TRACE_ID_KEY
from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from support.orchestrator import who

pytestmark = pytest.mark.integration

SERVICES = {"orchestrator", "embedding", "retrieval", "rerank", "generation", "budget"}


def spans_of(path: Path, trace_id: str) -> list[dict]:
    spans = []
    for line in path.read_text().splitlines():
        span = json.loads(line)
        if span["context"]["trace_id"] == f"0x{trace_id}":
            spans.append(span)
    return spans


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def ask(address: str, question: str):
    request = orchestrator_pb2.AskRequest(
        question=question,
        task_id=uuid.uuid4().hex,
        cache=orchestrator_pb2.CACHE_POLICY_BYPASS,
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        call = stub.Ask(request, timeout=120, metadata=who())
        messages = [m async for m in call]
        trailers = dict(await call.trailing_metadata())
    return messages[-1].result, trailers


async def wait_for_spans(
    path: Path,
    trace_id: str,
    services: set[str],
    timeout_s: float = 15,
    names=frozenset(),
    root_here: bool = True,
):
    """The trace's spans once every service in `services` exported some, its root (the Ask,
    which ends last; `root_here` False: the root is the caller's, never exported here) is
    there too, and so is every span named in `names` (exports are batched per process: a
    service's first batch may hold only its earlier calls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = await asyncio.to_thread(lambda: spans_of(path, trace_id) if path.exists() else [])
        seen = {s["resource"]["attributes"]["service.name"].removeprefix("ragline-") for s in spans}
        rooted = any(not s["parent_id"] for s in spans) or not root_here
        named = names <= {s["name"] for s in spans}
        if (services <= seen and rooted and named) or time.monotonic() > deadline:
            return spans
        await asyncio.sleep(0.2)


async def test_one_ask_is_one_trace_across_all_six_services(traced_stack):
    orchestrator = traced_stack.orchestrator()
    result, trailers = await ask(orchestrator.address, "Which river flows through Warsaw?")
    assert result.status.state == common_pb2.ANSWER_STATE_COMPLETE, result.status
    trace_id = result.timing.trace_id
    assert len(trace_id) == 32 and trailers[TRACE_ID_KEY] == trace_id

    path = Path(traced_stack.env["RAGLINE_TRACES_FILE"])
    engines_work = {"embedding model run", "search bm25", "etcd write", "decode"}
    spans = await wait_for_spans(path, trace_id, SERVICES, names=engines_work)
    by_service = {}
    for span in spans:
        name = span["resource"]["attributes"]["service.name"].removeprefix("ragline-")
        by_service.setdefault(name, []).append(span)
    assert set(by_service) == SERVICES

    # One root: the orchestrator's Ask; every other span's parent is in the trace.
    ids = {s["context"]["span_id"] for s in spans}
    roots = [s for s in spans if not s["parent_id"]]
    assert [r["name"] for r in roots] == ["ragline.v1.OrchestratorService/Ask"]
    assert all(s["parent_id"] in ids for s in spans if s["parent_id"]), "a parent is missing"
    parent = {s["context"]["span_id"]: s for s in spans}

    # Each inner service's call hangs under the orchestrator's client span of that call,
    # which hangs under the plan node that made it.
    for service in SERVICES - {"orchestrator"}:
        servers = [s for s in by_service[service] if s["kind"] == "SpanKind.SERVER"]
        assert servers, service
        for server in servers:
            client = parent[server["parent_id"]]
            assert client["kind"] == "SpanKind.CLIENT" and client["name"] == server["name"]
    generate = next(s for s in by_service["generation"] if s["kind"] == "SpanKind.SERVER")
    assert parent[parent[generate["parent_id"]]["parent_id"]]["name"].startswith("node ")
    # the engines' own work: a model run, a search, an etcd transaction, the decode
    names = {s["name"] for s in spans}
    assert engines_work <= names

    # The plan nodes' spans are the timing report's: same start and length within 1 ms.
    ask_span = roots[0]
    origin = epoch(ask_span["start_time"])
    nodes = {s["attributes"]["ragline.node.id"]: s for s in spans if s["name"].startswith("node ")}
    ran = [n for n in result.timing.nodes if n.state == orchestrator_pb2.NODE_STATE_SUCCEEDED]
    assert ran and {n.node_id for n in ran} <= set(nodes)
    for node in ran:
        span = nodes[node.node_id]
        start = node.began.ToTimedelta().total_seconds()
        assert abs((epoch(span["start_time"]) - origin) - start) < 0.001, node.node_id
        end = node.finished.ToTimedelta().total_seconds()
        assert abs((epoch(span["end_time"]) - origin) - end) < 0.001, node.node_id
        if node.HasField("settled"):  # its settlements, children that may end later
            # (a node that made several model calls, such as an answer read twice by the
            # verifier, settles each; the report's mark is the last)
            settle = max(
                (
                    s
                    for s in spans
                    if s["name"] == "budget settle" and s["parent_id"] == span["context"]["span_id"]
                ),
                key=lambda s: epoch(s["end_time"]),
            )
            settled = node.settled.ToTimedelta().total_seconds()
            assert abs((epoch(settle["end_time"]) - origin) - settled) < 0.001, node.node_id

    # A log line of the run carries the trace id.
    assert f'"trace_id": "{trace_id}"' in orchestrator.log()
    assert f'"trace_id": "{trace_id}"' in traced_stack.generation.log()


async def test_a_failed_call_still_returns_its_trace_id(traced_stack):
    orchestrator = traced_stack.orchestrator()
    async with grpc.aio.insecure_channel(orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        call = stub.Ask(orchestrator_pb2.AskRequest(), timeout=30, metadata=who())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [m async for m in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    trailers = dict(caught.value.trailing_metadata())
    assert len(trailers[TRACE_ID_KEY]) == 32


async def test_the_gateway_continues_the_http_callers_trace(traced_stack):
    """An HTTP caller's `traceparent` is the parent of the gateway's span, and the Ask the
    gateway makes is in the same trace, under it."""
    import httpx

    gateway = traced_stack.launcher.gateway(
        traced_stack.orchestrator(), traced_stack.embedding, traced_stack.retrieval,
        env=traced_stack.env,
    )  # fmt: skip
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    async with httpx.AsyncClient(base_url=f"http://{gateway.address}", timeout=120) as http:
        reply = await http.post(
            "/v1/chat/completions",
            json={
                "model": "ragline",
                "messages": [{"role": "user", "content": "Which river flows through Warsaw?"}],
                "ragline": {"cache": "bypass"},
            },
            headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"},
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["ragline"]["trace_id"] == caller_trace
    path = Path(traced_stack.env["RAGLINE_TRACES_FILE"])
    ask = "ragline.v1.OrchestratorService/Ask"
    wanted = {"POST /v1/chat/completions", ask}
    deadline = time.monotonic() + 15
    while True:  # both Ask spans: the gateway's call and the orchestrator's (batched apart)
        spans = await wait_for_spans(
            path, caller_trace, {"gateway", "orchestrator"}, names=wanted, root_here=False
        )
        if sum(s["name"] == ask for s in spans) >= 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    (http_span,) = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert http_span["parent_id"] == f"0x{caller_span}"
    assert http_span["attributes"]["http.response.status_code"] == 200
    # The gateway's call (CLIENT) under its request's span, the orchestrator's (SERVER)
    # under the call: the same name for both.
    asks = {s["parent_id"]: s for s in spans if s["name"] == ask}
    client = asks[http_span["context"]["span_id"]]
    assert client["context"]["span_id"] in asks
