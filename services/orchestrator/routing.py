"""Model routing: the small tier answers; the large tier is asked only when a checkable
signal says the small answer is wrong, never on the model's own confidence. Pure checks
here; the escalating call is the generate step's (steps.py), with its own reservation.

Signals (each names what fired):
- `citation_not_in_evidence`: the answer cites a marker the prompt did not hold;
- `missing_field`: a required field of the answer's structure is absent: the citation of
  a RAG answer (no marker, and no evidence passage holds the answer's words), or a part of
  a synthesis (fewer `;`-separated parts than lookups);
- `conflicting_evidence`: a one-part answer gives one number and a passage it cites does
  not hold it (two passages, two answers to the same slot);
- `failed_validation`: the answer is empty, or was cut by its token limit.
A refusal ("not in the evidence") fires nothing: INCOMPLETE is the honest answer there.
"""

from __future__ import annotations

import re

from ragline_services.orchestrator import evidence as ev

_NUMBER = re.compile(r"\b\d[\d,.]*\d\b|\b\d\b")


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in _NUMBER.findall(text)}


def escalation_signals(
    text: str, evidence: ev.Evidence, cited: ev.Cited, finish_reason: str, *, parts: int = 1
) -> list[str]:
    answer = ev.strip_markers(text).strip()
    if ev.is_refusal(text):
        return []
    signals = []
    if cited.dropped:
        signals.append(f"citation_not_in_evidence: {', '.join(cited.dropped)}")
    if not answer or finish_reason == "length":
        signals.append(
            "failed_validation: " + ("empty answer" if not answer else "cut at its limit")
        )
    if answer and not cited.citations and not cited.dropped:
        # Neither a marker nor a passage holding the answer's words: ungrounded.
        signals.append("missing_field: citation")
    if parts > 1 and len([p for p in answer.split(";") if p.strip()]) < parts:
        signals.append(f"missing_field: {parts} parts asked, fewer answered")
    given = _numbers(answer)
    if parts == 1 and len(given) == 1 and len(cited.citations) > 1:
        # The answer's number must be what every cited passage says, not one of several.
        disagreeing = [i.marker for i in cited.citations if given.isdisjoint(_numbers(i.text))]
        if disagreeing:
            signals.append(f"conflicting_evidence: {', '.join(disagreeing)} say otherwise")
    return signals
