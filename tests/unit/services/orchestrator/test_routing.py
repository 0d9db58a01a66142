"""Escalation signals: checkable facts about the small answer, never its confidence."""

from __future__ import annotations

from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.routing import escalation_signals


def evidence(*texts: str) -> ev.Evidence:
    items = tuple(
        ev.EvidenceItem(f"[{n}]", ev.Passage(f"d{n}", "", text), text)
        for n, text in enumerate(texts, start=1)
    )
    return ev.Evidence(items, 0, 0)


def signals(text: str, found: ev.Evidence, finish: str = "stop", parts: int = 1) -> list[str]:
    return escalation_signals(text, found, ev.cite(text, found), finish, parts=parts)


WARSAW = evidence("Warsaw lies on the Vistula.", "The library opened in 1999.")


def test_a_good_answer_fires_nothing():
    assert signals("the Vistula [1]", WARSAW) == []


def test_a_citation_outside_the_evidence_fires():
    assert signals("the Vistula [7]", WARSAW)[0] == "citation_not_in_evidence: [7]"


def test_a_missing_citation_or_part_is_a_missing_field():
    # No marker, but the evidence holds the answer's words: cited, nothing fires.
    assert signals("the Vistula", WARSAW) == []
    assert signals("the Danube", WARSAW) == ["missing_field: citation"]
    found = signals("the Vistula [1]", WARSAW, parts=2)
    assert found == ["missing_field: 2 parts asked, fewer answered"]
    assert signals("the Vistula [1]; 1999 [2]", WARSAW, parts=2) == []


def test_an_empty_or_cut_answer_fails_validation():
    assert signals("", WARSAW) == ["failed_validation: empty answer"]
    assert "failed_validation: cut at its limit" in signals("the Vistula [1]", WARSAW, "length")


def test_cited_passages_that_disagree_on_the_number_conflict():
    dates = evidence("The library opened in 1999.", "The library opened in 2002.")
    assert signals("1999 [1] [2]", dates) == ["conflicting_evidence: [2] say otherwise"]
    assert signals("1999 [1]", dates) == []


def test_a_refusal_is_an_honest_answer_not_a_signal():
    assert signals("not in the evidence", WARSAW) == []
