"""The orchestrator's own metrics, read from its /metrics after real asks: answers by state
and reason kind (bounded labels), plan node times by kind, answer-cache lookups."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from ragline.processes import free_ports
from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from support.metrics import scrape

pytestmark = pytest.mark.integration

WARSAW = "Which river flows through Warsaw?"
ELSEWHERE = "Who won the 2030 FIFA World Cup final in Ulaanbaatar?"


async def ask(address: str, question: str) -> orchestrator_pb2.AskResult:
    request = orchestrator_pb2.AskRequest(question=question, task_id=uuid.uuid4().hex)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        call = stub.Ask(request, timeout=120, metadata=(("x-ragline-tenant", "default"),))
        messages = [m async for m in call]
    return messages[-1].result


def samples(port: int, name: str, suffix: str = "_total") -> list:
    return [s for s in scrape(port).get(name, []) if s.name.endswith(suffix)]


async def test_answers_node_times_and_cache_lookups_are_counted(rag_stack):
    port = free_ports(1)[0]
    orchestrator = rag_stack.orchestrator(metrics_port=port)
    answered = await ask(orchestrator.address, WARSAW)
    again = await ask(orchestrator.address, WARSAW)  # from the answer cache
    refused = await ask(orchestrator.address, ELSEWHERE)
    assert answered.status.state == common_pb2.ANSWER_STATE_COMPLETE and again.cache.answer_hit
    assert refused.status.reason == "no_relevant_evidence", refused.status

    answers = {
        (s.labels["state"], s.labels["reason"], s.labels["tenant"]): s.value
        for s in samples(port, "ragline_orchestrator_answers")
    }
    # the default tenant is not named in RAGLINE_METRICS_TENANTS: "other"
    assert answers == {
        ("COMPLETE", "none", "other"): 2.0,
        ("INCOMPLETE", "no_relevant_evidence", "other"): 1.0,
    }
    lookups = {
        (s.labels["cache"], s.labels["result"]): s.value
        for s in samples(port, "ragline_orchestrator_cache_lookups")
    }
    assert lookups[("answer", "hit")] == 1.0 and lookups[("answer", "miss")] == 2.0
    nodes = {
        (s.labels["kind"], s.labels["state"]): s.value
        for s in samples(port, "ragline_orchestrator_node_seconds", "_count")
    }
    assert nodes[("generate", "SUCCEEDED")] == 1.0  # the refused question generated nothing
    assert nodes[("bm25", "SUCCEEDED")] == 2.0
    # and the calls themselves, as every service counts them
    handled = samples(port, "grpc_server_handled")
    assert [(s.labels["grpc_method"], s.labels["grpc_code"], s.value) for s in handled] == [
        ("Ask", "OK", 3.0)
    ]


async def test_admission_is_watched_and_refusals_are_counted_by_reason(rag_stack):
    port = free_ports(1)[0]
    orchestrator = rag_stack.orchestrator(
        small=True, max_in_flight=1, max_queue=0, metrics_port=port
    )

    def gauge(name: str) -> float:
        return samples(port, name, "")[0].value

    assert gauge("ragline_orchestrator_run_places") == 1.0
    assert gauge("ragline_orchestrator_runs_in_flight") == 0.0
    long = orchestrator_pb2.AskRequest(question=WARSAW, max_tokens=2000)
    metadata = (("x-ragline-tenant", "default"),)
    async with grpc.aio.insecure_channel(orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        running = stub.Ask(long, timeout=60, metadata=metadata)
        await running.read()  # admitted: it holds the only place
        assert gauge("ragline_orchestrator_runs_in_flight") == 1.0
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Ask(long, timeout=60, metadata=metadata):
                pass
        running.cancel()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    refusals = {s.labels["reason"]: s.value for s in samples(port, "ragline_orchestrator_refusals")}
    assert refusals == {"QUEUE_FULL": 1.0}


async def test_many_tenants_make_two_label_values(rag_stack):
    """Only the tenants RAGLINE_METRICS_TENANTS names are label values: 200 tenants asking
    leave `acme` and `other`, however many there are (1,000 proved no more: 23 s)."""
    port = free_ports(1)[0]
    orchestrator = rag_stack.orchestrator(
        metrics_port=port, env={"RAGLINE_METRICS_TENANTS": "acme"}
    )
    # one budget call: each ask ends INCOMPLETE at once (budget_exhausted), cheaply
    request = orchestrator_pb2.AskRequest(question=WARSAW, budget=common_pb2.BudgetAmounts(calls=1))
    tenants = ["acme", *(f"tenant-{n}" for n in range(199))]
    limit = asyncio.Semaphore(16)

    async def ask_as(stub, tenant: str) -> None:
        async with limit:
            metadata = (("x-ragline-tenant", tenant),)
            async for _ in stub.Ask(request, timeout=60, metadata=metadata):
                pass

    async with grpc.aio.insecure_channel(orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        await asyncio.gather(*(ask_as(stub, tenant) for tenant in tenants))
    answers = samples(port, "ragline_orchestrator_answers")
    by_tenant = {}
    for sample in answers:
        tenant = sample.labels["tenant"]
        by_tenant[tenant] = by_tenant.get(tenant, 0.0) + sample.value
    assert by_tenant == {"acme": 1.0, "other": 199.0}
