"""Plan steps whose rules do not need the services (the rest: tests/integration/...)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from ragline.budget import BudgetRefused
from ragline_services.orchestrator import evidence_steps, generation_steps, run_context
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
    assert await evidence_steps.rerank_query(ctx, current) is None
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
    assert await evidence_steps.rerank_query(Context(failure), current) is None
    assert "the rerank step encodes it" in current.record.note


async def test_a_cancelled_rerank_query_step_stays_cancelled():
    with pytest.raises(asyncio.CancelledError):
        await evidence_steps.rerank_query(Context(asyncio.CancelledError()), step())


def test_parts_stream_in_their_order_whatever_order_they_are_written_in():
    out: list[str] = []
    emitter = generation_steps._InOrder(out.append, 3, "; ")
    first, second, third = (emitter.part(i) for i in range(3))
    third("C")  # held: the parts before it are not done
    first("A")
    second("B")  # held behind the first part
    assert out == ["A"]
    first("a")
    emitter.finished(0)
    assert out == ["A", "a", "; ", "B"]
    emitter.finished(2)
    second("b")
    emitter.finished(1)
    assert "".join(out) == "Aa; Bb; C"


def test_a_several_part_answer_names_each_part_in_its_signals():
    from ragline.budget import Amounts
    from ragline_services.orchestrator import evidence as ev
    from ragline_services.orchestrator.routing import Signal

    def answer(text: str, problems=()):
        item = ev.EvidenceItem("[1]", ev.Passage("d", "", text), text)
        return run_context.Answer(
            text=text,
            evidence=ev.Evidence((item,), 3, 1),
            cited=ev.Cited([item], []),
            finish_reason="stop",
            usage=Amounts(input_tokens=10, calls=1),
            cached_input_tokens=0,
            model="m",
            tier=1,
            problems=tuple(problems),
        )

    unsupported = Signal("failed_validation", "not supported (x)", "ungrounded")
    joined = generation_steps._joined([answer("Vistula [1]"), answer("1999 [2]", [unsupported])])
    assert joined.text == "Vistula [1]; 1999 [2]"
    assert [str(p) for p in joined.problems] == ["failed_validation: part 2: not supported (x)"]
    assert joined.usage == Amounts(input_tokens=20, calls=2)
    assert len(joined.evidence.items) == 2 and len(joined.cited.citations) == 2
