"""Asking the orchestrator in tests."""

from __future__ import annotations

import grpc

from ragline.v1 import (
    budget_pb2,
    budget_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)


def who(tenant: str = "default") -> tuple[tuple[str, str], ...]:
    return (("x-ragline-tenant", tenant),)


async def ask(address: str, request: orchestrator_pb2.AskRequest, deadline_s: float = 120.0):
    """Every message of one Ask; the last is the result."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        return [m async for m in stub.Ask(request, timeout=deadline_s, metadata=who())]


async def ask_result(address: str, question: str, tenant: str = "default", **fields):
    """The result of one Ask (caches bypassed) and the text its deltas streamed."""
    request = orchestrator_pb2.AskRequest(
        question=question, cache=orchestrator_pb2.CACHE_POLICY_BYPASS, **fields
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        messages = [m async for m in stub.Ask(request, timeout=300, metadata=who(tenant))]
    deltas = "".join(m.delta for m in messages if m.WhichOneof("event") == "delta")
    return messages[-1].result, deltas


async def ledger(budget_address: str, task_id: str, tenant: str = "default"):
    async with grpc.aio.insecure_channel(budget_address) as channel:
        return await budget_pb2_grpc.BudgetServiceStub(channel).GetLedger(
            budget_pb2.GetLedgerRequest(task_id=task_id, include_reservations=True),
            timeout=10,
            metadata=who(tenant),
        )


async def generation_slot_free(generation_address: str) -> bool:
    """On a generation service with one slot and no queue, a request is refused at once
    while anything else still holds the slot."""
    async with grpc.aio.insecure_channel(generation_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            async for _ in stub.Generate(
                generation_pb2.GenerateRequest(prompt="Hi", max_tokens=1),
                timeout=30,
                metadata=who("probe"),
            ):
                pass
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return False
            raise
    return True


def answer_calls(requests) -> list:
    """The generation requests among `requests` that asked for an answer (not a planning
    call, nor the verifier's second read)."""
    from ragline_services.orchestrator.evidence import SYSTEM_PROMPT

    return [r for r in requests if r.chat.messages[0].content == SYSTEM_PROMPT]


def answering(text: str):
    """A script for the generation proxy: an answer prompt gets `text`; any other call (the
    verifier's second read, a planning call) goes to the real service."""
    from ragline_services.orchestrator.evidence import SYSTEM_PROMPT

    def script(request):
        return text if request.chat.messages[0].content == SYSTEM_PROMPT else None

    return script
