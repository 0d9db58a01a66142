"""Plan steps whose rules do not need the services (the rest: tests/integration/...)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from ragline.budget import BudgetRefused
from ragline_services.orchestrator import steps
from ragline_services.orchestrator.plan import Kind, Node
from ragline_services.orchestrator.runner import NodeRecord


class Context:
    def __init__(self, failure: BaseException | None) -> None:
        self.settings = SimpleNamespace(question="Which river flows through Warsaw?")
        self.failure = failure
        self.calls: list[tuple[str, str, object]] = []

    async def model_call(self, step, service, method, request, amounts, usage, **options):
        self.calls.append((service, method, request))
        self.options, self.amounts = options, amounts
        if self.failure is not None:
            raise self.failure
        return SimpleNamespace(usage=SimpleNamespace(input_tokens=9))


def step() -> SimpleNamespace:
    return SimpleNamespace(record=NodeRecord(Node("rerank_query", Kind.RERANK_QUERY)), inputs=[])


async def test_the_rerank_query_step_sends_the_question_to_prepare():
    ctx, current = Context(None), step()
    assert await steps.rerank_query(ctx, current) is None
    [(service, method, request)] = ctx.calls
    assert (service, method, request.query) == ("rerank", "Prepare", ctx.settings.question)
    assert not request.documents and current.record.note == ""
    # The rerank step's call, done early: tokens charged, no call of its own.
    assert ctx.options == {"counts_as_call": False} and ctx.amounts.calls == 0


@pytest.mark.parametrize(
    "failure",
    [
        grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "rerank is down"),
        BudgetRefused("no calls left"),
    ],
)
async def test_a_rerank_query_that_cannot_be_prepared_is_noted_and_does_not_fail(failure):
    current = step()
    assert await steps.rerank_query(Context(failure), current) is None
    assert "the rerank step encodes it" in current.record.note


async def test_a_cancelled_rerank_query_step_stays_cancelled():
    with pytest.raises(asyncio.CancelledError):
        await steps.rerank_query(Context(asyncio.CancelledError()), step())
