"""Escalation signals: checkable facts about the small answer, never its confidence; each
names the INCOMPLETE reason it gives when nothing cures it."""

from __future__ import annotations

from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.routing import escalation_signals


def evidence(*texts: str) -> ev.Evidence:
    items = tuple(
        ev.EvidenceItem(f"[{n}]", ev.Passage(f"d{n}", "", text), text)
        for n, text in enumerate(texts, start=1)
    )
    return ev.Evidence(items, 0, 0)


def fired(text: str, found: ev.Evidence, finish: str = "stop"):
    return escalation_signals(text, found, ev.cite(text, found), finish, question="Q?")


def signals(text: str, found: ev.Evidence, finish: str = "stop") -> list[str]:
    return [str(s) for s in fired(text, found, finish)]


WARSAW = evidence("Warsaw lies on the Vistula.", "The library opened in 1999.")


def test_a_good_answer_fires_nothing():
    assert signals("the Vistula [1]", WARSAW) == []


def test_a_citation_outside_the_evidence_fires_and_is_ungrounded():
    found = fired("the Vistula [7]", WARSAW)
    assert str(found[0]) == "citation_not_in_evidence: [7]"
    assert found[0].reason == "ungrounded"


def test_a_missing_citation_is_a_missing_field():
    # No marker, but the evidence holds the answer's words: cited, nothing fires.
    assert signals("the Vistula", WARSAW) == []
    found = fired("the Danube", WARSAW)
    assert [str(s) for s in found] == ["missing_field: citation"]
    assert found[0].reason == "ungrounded"


def test_an_answer_to_a_joined_question_must_answer_every_part():
    found = escalation_signals(
        "the Vistula [1]", WARSAW, ev.cite("the Vistula [1]", WARSAW), "stop", parts=2
    )
    assert [str(s) for s in found] == ["missing_field: 2 parts asked, 1 answered"]
    assert found[0].reason == "missing_part"
    both = "the Vistula [1]; 1999 [2]"
    assert escalation_signals(both, WARSAW, ev.cite(both, WARSAW), "stop", parts=2) == []


def test_an_answer_its_citation_does_not_support_fails_validation():
    # Cited, but the cited passage says nothing of the Danube or of 2001.
    found = fired("the Danube [1]", WARSAW)
    assert [s.name for s in found] == ["failed_validation"] and found[0].reason == "ungrounded"
    assert "danube" in str(found[0])
    assert signals("in 2001 [2]", WARSAW) == [
        "failed_validation: not supported by its citations (2001)"
    ]


def test_an_empty_or_cut_answer_fails_validation():
    assert signals("", WARSAW) == ["failed_validation: empty answer"]
    cut = fired("the Vistula [1]", WARSAW, "length")
    assert [str(s) for s in cut] == ["failed_validation: cut at its limit"]
    assert cut[0].reason == "length"  # a grounded cut answer stands, PARTIAL


def test_cited_passages_that_disagree_on_the_number_conflict():
    dates = evidence("The library opened in 1999.", "The library opened in 2002.")
    found = fired("1999 [1] [2]", dates)
    assert [str(s) for s in found] == ["conflicting_evidence: [2] say otherwise"]
    assert found[0].reason == "conflicting_evidence"
    assert signals("1999 [1]", dates) == []


def test_a_refusal_is_an_honest_answer_not_a_signal():
    assert signals("not in the evidence", WARSAW) == []
