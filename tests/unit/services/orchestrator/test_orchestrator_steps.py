"""Plan steps whose rules do not need the services (the rest: tests/integration/...)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from ragline.budget import BudgetRefused
from ragline.v1 import generation_pb2
from ragline_services.orchestrator import (
    agent_steps,
    evidence_steps,
    generation_call,
    run_context,
)
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
    emitter = agent_steps._InOrder(out.append, 3, "; ")
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
    joined = agent_steps._joined([answer("Vistula [1]"), answer("1999 [2]", [unsupported])])
    assert joined.text == "Vistula [1]; 1999 [2]"
    assert [str(p) for p in joined.problems] == ["failed_validation: part 2: not supported (x)"]
    assert joined.usage == Amounts(input_tokens=20, calls=2)
    assert len(joined.evidence.items) == 2 and len(joined.cited.citations) == 2


FINAL = SimpleNamespace(timing=None)


class SlowStream:
    """A Generate stream: its text once `speak` is set, its final message once `finish` is."""

    def __init__(self) -> None:
        self.speak, self.finish = asyncio.Event(), asyncio.Event()
        self.closed = False
        self.requests: list[object] = []

    async def stream(self, method, request):
        self.requests.append(request)
        try:
            await self.speak.wait()
            yield SimpleNamespace(text="Vistula", HasField=lambda name: False)
            await self.finish.wait()
            yield SimpleNamespace(text="", HasField=lambda name: True, final=FINAL)
        finally:
            self.closed = True


def generating_step() -> SimpleNamespace:
    node = Node("answer", Kind.GENERATE)
    return SimpleNamespace(node=node, record=NodeRecord(node), mark=lambda what: None)


def read_watching(client: SlowStream) -> tuple[list[str], asyncio.Event, asyncio.Task]:
    """The text read so far, the event that says the tenant turned light, and the task
    reading `client`'s generation while it watches that event."""
    pieces, turned = [], asyncio.Event()
    reading = asyncio.create_task(
        generation_call.read_generation(client, "req", generating_step(), pieces, None, turned)
    )
    return pieces, turned, reading


async def test_a_generation_whose_tenant_turns_light_before_its_first_token_ends_to_go_again():
    client = SlowStream()
    client.finish.set()
    pieces, turned, reading = read_watching(client)
    await asyncio.sleep(0.01)
    turned.set()
    with pytest.raises(generation_call.TurnedLight):
        await reading
    assert client.closed and pieces == []  # the call ended, nothing of it went out


async def test_a_generation_already_speaking_when_its_tenant_turns_light_runs_on():
    client = SlowStream()
    client.speak.set()
    pieces, turned, reading = read_watching(client)
    await asyncio.sleep(0.01)
    assert pieces == ["Vistula"]
    turned.set()
    await asyncio.sleep(0.01)
    assert not reading.done() and not client.closed  # its text is out: it is not cut
    client.finish.set()
    assert await reading is FINAL and pieces == ["Vistula"]


class Run:
    """What a generation step uses of its run: the client, whether the tenant is light."""

    until_light = run_context.RunContext.until_light
    turn_light_if_so = run_context.RunContext.turn_light_if_so

    def __init__(self, client: SlowStream) -> None:
        self.clients = SimpleNamespace(generation=client, limits={"generation": asyncio.Lock()})
        self.light = False
        self.light_tenant = lambda: self.light
        self._unmarked: set[asyncio.Event] = set()
        self.raised_light = 0


@pytest.mark.parametrize("light_first", [True, False])
async def test_a_generation_goes_again_marked_only_where_its_tier_serves_light_first(light_first):
    client = SlowStream()
    run = Run(client)
    sent: list[bool] = []
    original = client.stream

    def stream(method, request):
        sent.append(request.light_tenant)
        return original(method, request)

    client.stream = stream
    current = generating_step()
    generating = asyncio.create_task(
        generation_call.stream_generation(
            run, current, generation_pb2.GenerateRequest(), [], None, [0], raise_light=light_first
        )
    )
    await asyncio.sleep(0.01)
    run.light = True  # a flood began: the front door says so
    run.turn_light_if_so()
    await asyncio.sleep(0.01)
    client.speak.set()
    client.finish.set()
    await generating
    assert sent == ([False, True] if light_first else [False])
    assert run.raised_light == (1 if light_first else 0)
    assert current.record.attempts == len(sent)
