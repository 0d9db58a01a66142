"""The agent plan with every service a real process: the router looks up each question a
joined question holds (no planning call), the planner's lookups run concurrently (read off
the timing report), a tight budget drops optional lookups with PARTIAL, a malformed plan
falls back to the RAG plan. Where the model must say something on cue, a proxy in front of
the real generation service says it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import pytest

from ragline.processes import free_ports
from ragline.v1 import common_pb2, orchestrator_pb2
from ragline_services.orchestrator.answer_step import ESCALATE_FROM
from support.generation_proxy import GenerationProxy, is_planning
from support.metrics import sample_values, scrape
from support.orchestrator import answer_calls, ask_result
from support.retrieval import Client

pytestmark = pytest.mark.integration

TWO_PARTS = "Which river flows through Warsaw, and also who designed the University Library garden?"
# For tests of the plan's mechanics: the verifier off, so that whether the real model's
# part answers stand does not turn on its estimate near the threshold (the verifier's own
# tests are test_answer_trust.py's).
PLAN_ONLY = {"verify_threshold": 0}


async def ask(address: str, question: str, **fields) -> orchestrator_pb2.AskResult:
    result, _ = await ask_result(address, question, **fields)
    return result


def interval(node) -> tuple[float, float]:
    return node.call_start.ToNanoseconds() / 1e9, node.call_end.ToNanoseconds() / 1e9


def lookups(result) -> list:
    return [n for n in result.timing.nodes if n.kind == orchestrator_pb2.NODE_KIND_RETRIEVE]


def plan_of(*subqueries: tuple[str, bool]) -> str:
    return json.dumps(
        {"subqueries": [{"query": q, "required": required} for q, required in subqueries]}
    )


async def test_the_router_looks_up_each_question_a_question_joins_with_no_planning_call(
    proxied,
):
    proxy, orchestrator = await proxied()
    result = await ask(orchestrator.address, TWO_PARTS)
    assert result.route == "agent", result.route_detail
    assert "the router's 2 questions" in result.route_detail
    # its own clauses are the lookups, and the parts the answers answer
    assert list(result.subqueries) == [
        "Which river flows through Warsaw",
        "who designed the University Library garden?",
    ]
    assert not any(is_planning(r) for r in proxy.forwarded)
    assert "plan" not in {n.node_id for n in result.timing.nodes}
    first, second = lookups(result)
    (a_start, a_end), (b_start, b_end) = interval(first), interval(second)
    assert a_start < b_end and b_start < a_end  # side by side
    assert len(answer_calls(proxy.forwarded)) == 2  # one generation per part
    assert result.status.state == common_pb2.ANSWER_STATE_COMPLETE, (result.status, result)
    first_part, second_part = result.answer.split(";")
    assert "vistula" in first_part.lower() and "bajerska" in second_part.lower(), result.answer


async def test_the_planners_lookups_run_together(proxied):
    plan = plan_of(("river through Warsaw", True), ("University Library garden designer", True))
    proxy, orchestrator = await proxied(lambda r: plan if is_planning(r) else None, **PLAN_ONLY)
    result = await ask(
        orchestrator.address, TWO_PARTS, plan_choice=orchestrator_pb2.PLAN_CHOICE_AGENT
    )
    assert result.route == "agent", result.route_detail
    assert list(result.subqueries) == ["river through Warsaw", "University Library garden designer"]
    first, second = lookups(result)
    # Concurrent, as measured: each lookup started before the other ended.
    (a_start, a_end), (b_start, b_end) = interval(first), interval(second)
    assert a_start < b_end and b_start < a_end
    assert [n.depends_on for n in (first, second)] == [["plan"], ["plan"]]
    synthesis = next(n for n in result.timing.nodes if n.node_id == "synthesize")
    assert synthesis.state == orchestrator_pb2.NODE_STATE_SUCCEEDED
    # The synthesis answered from the real model, one generation per part.
    assert len(answer_calls(proxy.forwarded)) == 2 and len(proxy.scripted) == 1
    titles = {e.title for e in result.evidence}
    assert "Warsaw" in titles
    assert any("Bajerska" in e.snippet for e in result.evidence), result.evidence
    assert result.status.state == common_pb2.ANSWER_STATE_COMPLETE, (result.status, result)
    # Each part cites its own passage: the river's and the garden's.
    first_part, second_part = result.answer.split(";")
    assert "vistula" in first_part.lower() and "bajerska" in second_part.lower(), result.answer
    cited = {c.marker: c.snippet for c in result.citations}
    assert any("Vistula" in snippet for snippet in cited.values())
    assert any("Bajerska" in snippet for snippet in cited.values())


async def test_a_tight_budget_drops_the_optional_lookup_and_the_answer_is_partial(proxied):
    plan = plan_of(("river through Warsaw", True), ("University Library garden designer", False))
    _, orchestrator = await proxied(lambda r: plan if is_planning(r) else None, **PLAN_ONLY)
    # Enough for the planning call, one lookup (its search and its part's answer) and the
    # synthesis's embedding of the evidence; not for the second lookup.
    budget = common_pb2.BudgetAmounts(input_tokens=1200, output_tokens=400, calls=4)
    agent = orchestrator_pb2.PLAN_CHOICE_AGENT  # the planner marks the second lookup optional
    result = await ask(
        orchestrator.address, TWO_PARTS, budget=budget, allow_degrade=True, plan_choice=agent
    )
    assert result.route == "agent"
    assert [n.node_id for n in lookups(result)] == ["lookup1"]
    assert any(d.startswith("lookup_dropped_budget") for d in result.degraded), result.degraded
    assert result.status.state == common_pb2.ANSWER_STATE_PARTIAL, result.status
    for amount in ("input_tokens", "output_tokens", "calls"):
        assert getattr(result.budget.used, amount) <= getattr(budget, amount)
    # Without leave to degrade nothing is dropped in advance: the budget refuses a call and
    # the answer is INCOMPLETE, never a guess.
    strict = await ask(orchestrator.address, TWO_PARTS, budget=budget, plan_choice=agent)
    assert not any(d.startswith("lookup_dropped") for d in strict.degraded)
    assert strict.status.state == common_pb2.ANSWER_STATE_INCOMPLETE, strict.status


async def test_a_malformed_plan_is_asked_for_again_then_the_rag_plan_answers(proxied):
    proxy, orchestrator = await proxied(
        lambda r: "Sure! First look up Warsaw." if is_planning(r) else None
    )
    result = await ask(
        orchestrator.address,
        "Which river flows through Warsaw?",
        plan_choice=orchestrator_pb2.PLAN_CHOICE_AGENT,
    )
    assert len(proxy.scripted) == 2  # asked once more, with what was wrong
    assert "not a valid plan" in proxy.scripted[1].chat.messages[-1].content
    assert result.route == "rag_fallback"
    assert "answered with the RAG plan" in result.status.detail
    assert {"plan", "embed", "bm25", "generate"} <= {n.node_id for n in result.timing.nodes}
    assert "vistula" in result.answer.lower()


def small_answer(text: str):
    """A script: the small tier's answers are `text` (the planner's too)."""

    def script(request):
        if request.tier == common_pb2.MODEL_TIER_SMALL and not is_planning(request):
            return text
        return None

    return script


@contextlib.asynccontextmanager
async def small_answers_fail(rag_stack, **settings):
    """A proxy whose small tier answers "the Vistula [7]" (a citation outside the evidence)
    and which plays the large tier with the real model, and an orchestrator behind it
    (`settings`: RAGLINE_ORCHESTRATOR_* values)."""
    proxy = GenerationProxy(
        rag_stack.generation.address, small_answer("the Vistula [7]"), large_as_small=True
    )
    await proxy.start()
    try:
        orchestrator = await asyncio.to_thread(
            rag_stack.orchestrator, generation_addr=proxy.address, **settings
        )
        yield proxy, orchestrator
    finally:
        await proxy.stop()


async def test_a_citation_outside_the_evidence_escalates_and_the_reason_is_recorded(rag_stack):
    async with small_answers_fail(rag_stack) as (proxy, orchestrator):
        result = await ask(orchestrator.address, "Which river flows through Warsaw?")
        assert result.escalated, list(result.escalation_signals)
        assert list(result.escalation_signals) == ["citation_not_in_evidence: [7]"]
        assert proxy.forwarded[-1].tier == common_pb2.MODEL_TIER_LARGE  # the escalation
        assert "vistula" in result.answer.lower() and "[7]" not in result.answer
        assert result.escalation_cured and result.status.state == common_pb2.ANSWER_STATE_COMPLETE
        # A pinned tier is never escalated.
        pinned = await ask(
            orchestrator.address,
            "Which river flows through Warsaw?",
            tier=common_pb2.MODEL_TIER_SMALL,
        )
        # Its answer failed a check that nothing cured: INCOMPLETE, the text only a draft.
        assert not pinned.escalated and pinned.draft_answer == "the Vistula [7]"
        assert pinned.answer == "" and not pinned.citations
        assert pinned.status.state == common_pb2.ANSWER_STATE_INCOMPLETE
        assert pinned.status.reason == "ungrounded", pinned.status
        assert list(pinned.dropped_citations) == ["[7]"]
        # The escalation has its own reservation: when the budget cannot pay for it, the
        # small answer stands with the signal and the reason.
        four_calls = common_pb2.BudgetAmounts(input_tokens=100_000, output_tokens=2_000, calls=4)
        tight = await ask(
            orchestrator.address, "Which river flows through Warsaw?", budget=four_calls
        )
        assert not tight.escalated
        assert list(tight.escalation_signals) == [
            "citation_not_in_evidence: [7]",
            "escalation_unaffordable",
        ]
        assert tight.status.state == common_pb2.ANSWER_STATE_INCOMPLETE
        assert tight.draft_answer == "the Vistula [7]"
        assert tight.budget.used.calls <= 4


async def test_no_escalation_beside_other_runs_or_where_the_evidence_likely_does_not_answer(
    rag_stack,
):
    """Escalation is optional work: a failed small answer goes to the large tier only while
    no other run is in flight here, and only where the evidence likely answers; each one
    not made is counted by why."""
    (metrics_port,) = free_ports(1)
    async with small_answers_fail(rag_stack, metrics_port=metrics_port) as (proxy, orchestrator):
        # Two runs whose small answers fail: the first one's answer is written while the
        # second is in flight (its scripted answer takes two seconds), the second's once the
        # first has ended.
        proxy.hold_s = 2.0
        first = asyncio.ensure_future(
            ask(orchestrator.address, "Which river flows through Warsaw?")
        )
        await asyncio.sleep(1.0)
        second = await ask(orchestrator.address, "Which river flows through Warsaw?")
        first_result = await first
        assert not first_result.escalated, list(first_result.escalation_signals)
        assert list(first_result.escalation_signals) == [
            "citation_not_in_evidence: [7]",
            "escalation_skipped: 1 other run in flight",
        ]
        assert first_result.status.state == common_pb2.ANSWER_STATE_INCOMPLETE
        assert second.escalated and second.escalation_cured, list(second.escalation_signals)
        proxy.hold_s = 0.0
        # Evidence that likely does not answer (the gate let it through, below
        # ESCALATE_FROM): the large tier is not asked.
        tenant = f"weak-{uuid.uuid4().hex[:8]}"
        client = Client(rag_stack.retrieval.address)
        await client.upsert(
            tenant,
            [
                {
                    "id": "zstd-env",
                    "title": "zstd environment variables",
                    "text": "Only two environment variables are read by zstd. ZSTD_CLEVEL "
                    "sets the compression level used when the command line gives none.",
                }
            ],
        )
        await client.close()
        weak = await ask(
            orchestrator.address,
            "Which environment variable sets the compression level of gzip?",
            tenant=tenant,
        )
        assert 0 < weak.answerability < ESCALATE_FROM, weak.answerability
        assert not weak.escalated
        assert weak.escalation_signals[-1].startswith(
            "escalation_skipped: the evidence likely does not answer"
        ), list(weak.escalation_signals)
    found = scrape(metrics_port)
    not_made = sample_values(found, "ragline_orchestrator_escalations_not_made", "_total")
    assert not_made == {("others_in_flight",): 1.0, ("evidence_unlikely",): 1.0}, not_made


def _answers_part(request, part: str) -> bool:
    """A generation asked to answer `part` of a several-part question (its prompt holds the
    whole question, and the part it answers on a line of its own)."""
    messages = request.chat.messages
    return bool(messages) and f"only this part of it: {part}" in messages[-1].content


async def test_a_part_whose_answer_fails_its_checks_leaves_the_other_part_standing(proxied):
    # The garden's part answers with a name its evidence does not hold: not grounded, and
    # no large tier here to cure it. The river's part is the real model's.
    proxy, orchestrator = await proxied(
        lambda r: "Napoleon Bonaparte" if _answers_part(r, "who designed") else None
    )
    result = await ask(orchestrator.address, TWO_PARTS)
    assert result.route == "agent", result.route_detail
    assert proxy.scripted  # the garden's part was asked, and answered on cue
    # Not COMPLETE (a part has no answer), but the part that stands is kept, cited.
    assert result.status.state == common_pb2.ANSWER_STATE_INCOMPLETE, result.status
    assert result.status.reason == "missing_part", result.status
    assert "who designed the University Library garden?" in result.status.detail
    assert "vistula" in result.answer.lower() and "napoleon" not in result.answer.lower()
    assert any("Vistula" in c.snippet for c in result.citations), result.citations
    assert "Napoleon" in result.draft_answer
    # With leave to degrade, the same answer is PARTIAL and names the part left out.
    degraded = await ask(orchestrator.address, TWO_PARTS, allow_degrade=True)
    assert degraded.status.state == common_pb2.ANSWER_STATE_PARTIAL, degraded.status
    assert "vistula" in degraded.answer.lower() and "napoleon" not in degraded.answer.lower()
    assert list(degraded.degraded) == [
        "part_failed_checks: who designed the University Library garden?"
    ]


async def test_a_part_no_evidence_answers_is_named_and_the_other_part_answered(proxied):
    question = (
        "Which river flows through Warsaw, and also who won the 1998 Tour de France cycling race?"
    )
    proxy, orchestrator = await proxied()
    result = await ask(orchestrator.address, question)
    assert result.route == "agent", result.route_detail
    assert len(answer_calls(proxy.forwarded)) == 1  # nothing generated for the other part
    assert result.status.state == common_pb2.ANSWER_STATE_INCOMPLETE, result.status
    assert result.status.reason == "missing_part", result.status
    assert "Tour de France" in result.status.detail, result.status.detail
    assert "vistula" in result.answer.lower() and result.citations, result
    assert result.draft_answer == ""
