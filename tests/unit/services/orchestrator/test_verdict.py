"""The verdict on a run: COMPLETE only for an answer that cleared its checks and cites a
passage; every other ending named (state, reason, words) and the unverified text kept apart
as a draft."""

from __future__ import annotations

import pytest

from ragline.budget import Amounts, BudgetRefused
from ragline.errors import DeadlineExceeded
from ragline.v1 import common_pb2
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator import routing
from ragline_services.orchestrator.plan import Kind, Node
from ragline_services.orchestrator.run_context import Answer, NoEvidence
from ragline_services.orchestrator.runner import Abstain, NodeRecord, NodeState
from ragline_services.orchestrator.verdict import (
    AnswerState,
    abstained,
    answered,
    failed,
)

ITEM = ev.EvidenceItem("[1]", ev.Passage("doc-1", "Normans", "", 3), "Rollo led the Normans.")
EVIDENCE = ev.Evidence(items=(ITEM,), tokens=6, sentences_considered=1)


def answer(text="Rollo [1]", *, cited=(ITEM,), dropped=(), finish="stop", **fields) -> Answer:
    return Answer(
        text=text,
        evidence=EVIDENCE,
        cited=ev.Cited(list(cited), list(dropped)),
        finish_reason=finish,
        usage=Amounts(input_tokens=100, output_tokens=4),
        cached_input_tokens=64,
        model="small-model",
        tier=common_pb2.MODEL_TIER_SMALL,
        **fields,
    )


def test_a_cited_answer_that_cleared_its_checks_is_complete_and_whole():
    verdict, written = answered(answer(), degraded=[])
    assert (verdict.state, verdict.reason, verdict.detail) == (AnswerState.COMPLETE, "", "")
    assert written.answer == "Rollo [1]" and written.citations == [ITEM]
    assert written.evidence == [ITEM] and written.draft_answer == ""
    assert (written.model, written.prefill_tokens_saved) == ("small-model", 64)


def test_an_answer_that_failed_a_check_is_a_draft_never_the_answer():
    problem = routing.Signal("unsupported_number", "1066 is not in the evidence", "ungrounded")
    verdict, written = answered(
        answer("In 1066 [1]", problems=(problem,), signals=(problem,), escalated=True), []
    )
    assert (verdict.state, verdict.reason) == (AnswerState.INCOMPLETE, "ungrounded")
    assert "1066 is not in the evidence" in verdict.detail
    assert "large tier" in verdict.detail
    assert written.answer == "" and written.citations == []
    assert written.draft_answer == "In 1066 [1]"
    assert written.escalated and not written.escalation_cured
    assert written.signals == ["unsupported_number: 1066 is not in the evidence"]


def test_an_answer_without_a_citation_is_never_complete():
    verdict, written = answered(answer("Rollo", cited=()), [])
    assert (verdict.state, verdict.reason) == (AnswerState.INCOMPLETE, "ungrounded")
    assert written.answer == "" and written.draft_answer == "Rollo"


def test_a_refusal_is_incomplete_without_citations():
    verdict, written = answered(answer("That is not in the evidence [1]."), [])
    assert (verdict.state, verdict.reason) == (AnswerState.INCOMPLETE, "not_in_evidence")
    assert written.citations == []


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"finish": "deadline"}, "deadline"),
        ({"problems": (routing.Signal("cut", "", routing.CUT),)}, "length"),
    ],
)
def test_a_cut_answer_is_partial_and_keeps_its_text(fields, reason):
    verdict, written = answered(answer(**fields), [])
    assert (verdict.state, verdict.reason) == (AnswerState.PARTIAL, reason)
    assert written.answer == "Rollo [1]" and written.citations == [ITEM]


def test_skipped_optional_steps_make_it_partial_naming_them():
    verdict, _ = answered(answer(), ["rerank_unavailable", "embed_skipped"])
    assert verdict.state == AnswerState.PARTIAL
    assert verdict.reason == "degraded: rerank_unavailable, embed_skipped"


def test_dropped_citations_are_named_after_what_else_is_said():
    verdict, written = answered(answer(dropped=("[7]",)), ["rerank_unavailable"])
    assert verdict.detail.endswith("; dropped citations not in the evidence: [7]")
    assert written.dropped_citations == ["[7]"]
    alone, _ = answered(answer(dropped=("[7]",)), [])
    assert alone.detail == "dropped citations not in the evidence: [7]"


def record(kind: Kind, state: NodeState, exception: BaseException | None = None) -> NodeRecord:
    return NodeRecord(
        Node(kind.value, kind), state=state, exception=exception, error=str(exception or "")
    )


def test_an_abstention_is_incomplete_with_the_gate_s_reason():
    decision = Abstain("no_relevant_evidence", "the evidence does not answer it")
    verdict = abstained(record(Kind.SELECT_EVIDENCE, NodeState.SUCCEEDED, decision))
    assert (verdict.state, verdict.reason, verdict.detail) == (
        AnswerState.INCOMPLETE,
        "no_relevant_evidence",
        "the evidence does not answer it",
    )


def test_failures_are_named_by_what_failed():
    refused = record(Kind.GENERATE, NodeState.FAILED, BudgetRefused("output tokens: 0 left"))
    assert failed(refused, {}).reason == "budget_exhausted"
    empty = record(Kind.BM25, NodeState.FAILED, NoEvidence("nothing matched"))
    assert (failed(empty, {}).reason, failed(empty, {}).detail) == (
        "no_evidence",
        "nothing matched",
    )
    broken = record(Kind.RERANK, NodeState.FAILED, RuntimeError("engine gone"))
    verdict = failed(broken, {})
    assert (verdict.state, verdict.reason) == (AnswerState.INCOMPLETE, "rerank_failed")
    assert "engine gone" in verdict.detail


def test_a_deadline_in_generation_after_the_evidence_is_partial_before_it_an_error():
    late = record(Kind.GENERATE, NodeState.FAILED, DeadlineExceeded("out of time"))
    evidence_in = {"select": record(Kind.SELECT_EVIDENCE, NodeState.SUCCEEDED)}
    verdict = failed(late, evidence_in)
    assert (verdict.state, verdict.reason) == (AnswerState.PARTIAL, "deadline")
    with pytest.raises(DeadlineExceeded, match="before the evidence was in"):
        failed(late, {})
    early = record(Kind.BM25, NodeState.FAILED, TimeoutError())
    with pytest.raises(DeadlineExceeded, match="step bm25"):
        failed(early, evidence_in)


def test_a_part_without_an_answer_standing_is_named_and_the_parts_that_stand_are_kept():
    from ragline_services.orchestrator.run_context import MissingPart

    missing = MissingPart("who designed the garden", "failed_validation: not supported", "X [2]")
    verdict, written = answered(answer(missing_parts=(missing,)), degraded=[])
    assert (verdict.state, verdict.reason) == (AnswerState.INCOMPLETE, routing.MISSING_PART)
    assert "'who designed the garden'" in verdict.detail
    # The part that stands is the answer, cited; the missing part's text is a draft.
    assert written.answer == "Rollo [1]" and written.citations == [ITEM]
    assert written.draft_answer == "X [2]"
    # Where no part stands either, the run fails as one answer would, naming both.
    failing = (routing.Signal("failed_validation", "not supported", routing.FAILED_VALIDATION),)
    verdict, _ = answered(answer(problems=failing, missing_parts=(missing,)), degraded=[])
    assert verdict.reason == routing.FAILED_VALIDATION
    assert "'who designed the garden'" in verdict.detail
