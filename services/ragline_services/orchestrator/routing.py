"""Checks of a written answer, which are also the model-routing signals: the small tier
answers; the large tier answers instead when a checkable signal says the small answer is
wrong, and cross-checks one that passed where the verifier's estimate is unsure (never on
the model's own confidence alone). A signal that the large tier's answer does not clear
ends the answer INCOMPLETE with the signal's `reason` (COMPLETE is a promise). Pure checks
here; the large tier's call is the answer step's (answer_step.py), with its own
reservation.

Signals (each names what fired):
- `citation_not_in_evidence`: the answer cites a marker the prompt did not hold;
- `missing_field`: a required field of the answer is absent: its citation (no marker, and
  no evidence passage holds the answer's words), or a part of a question that joins
  several (one answer, fewer `;`-separated parts than the question's clauses);
- `failed_validation`: the answer is empty, was cut by its token limit, or is not supported
  by the passages it cites (grounding.py: its numbers and words are not found there);
- `conflicting_evidence`: a one-part answer gives one number and a passage it cites does
  not hold it (two passages, two answers to the same slot).
- `failed_validation` (reason `failed_validation`): the answer repeats the prompt's own
  instruction;
- `unverified` (set by the answer step, answer_step.py): the verifier (verifier.py)
  judged that the answer is not the one the question asks for, or its second read
  (second_read.py) chose another candidate of the answer's citation, or the large tier's
  cross-check of an answer the verifier passed unsure gave another answer, which failed
  its own checks.
A refusal ("not in the evidence") fires nothing: INCOMPLETE is the honest answer there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ragline.vocabulary import FinishReason
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator import grounding

_NUMBER = re.compile(r"\b\d[\d,.]*\d\b|\b\d\b")

# The INCOMPLETE reasons a signal gives when it is not cured.
UNGROUNDED = "ungrounded"
CONFLICTING = "conflicting_evidence"
FAILED_VALIDATION = "failed_validation"
MISSING_PART = "missing_part"
UNVERIFIED = "unverified"
CUT = "length"  # not INCOMPLETE: the answer is PARTIAL, cut at its token limit


@dataclass(frozen=True)
class Signal:
    name: str
    detail: str
    reason: str  # the answer's INCOMPLETE reason when nothing cures it

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}" if self.detail else self.name


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in _NUMBER.findall(text)}


# The prompt's own words (instruction and labels): an answer made of them is an echo.
_PROMPT_WORDS = frozenset(ev.content_words(ev.SYSTEM_PROMPT + " evidence question answer part"))


def echoes_instruction(answer: str) -> bool:
    """Whether `answer` mostly repeats the prompt's instruction ("a few words copied from
    the evidence, no sentence."), as a small model does when it reads no answer."""
    words = ev.content_words(answer)
    if len(words) < 3:
        return False
    return sum(w in _PROMPT_WORDS for w in words) / len(words) >= 0.6


def escalation_signals(
    text: str,
    evidence: ev.Evidence,
    cited: ev.Cited,
    finish_reason: FinishReason,
    *,
    question: str = "",
    parts: int = 1,
) -> list[Signal]:
    """The checks that fail on an answer to `question`; `parts`: how many questions it joins
    (an answer to several must give as many `;`-separated parts)."""
    answer = ev.strip_markers(text).strip()
    if ev.is_refusal(text):
        return []
    signals = []
    if cited.dropped:
        signals.append(Signal("citation_not_in_evidence", ", ".join(cited.dropped), UNGROUNDED))
    if not answer:
        signals.append(Signal("failed_validation", "empty answer", FAILED_VALIDATION))
    elif finish_reason == FinishReason.LENGTH:
        # A cut answer whose written part is grounded stands, PARTIAL (reason `length`).
        signals.append(Signal("failed_validation", "cut at its limit", CUT))
    if not answer:
        return signals
    if echoes_instruction(answer):
        signals.append(
            Signal("failed_validation", "it repeats the prompt's instruction", FAILED_VALIDATION)
        )
        return signals
    given_parts = len([p for p in answer.split(";") if p.strip()])
    if parts > given_parts:
        signals.append(
            Signal("missing_field", f"{parts} parts asked, {given_parts} answered", MISSING_PART)
        )
    if not cited.citations and not cited.dropped:
        # Neither a marker nor a passage holding the answer's words: ungrounded.
        signals.append(Signal("missing_field", "citation", UNGROUNDED))
    elif cited.citations:
        found = grounding.support(text, cited.citations, question)
        if not found.supported:
            missing = ", ".join(found.missing[:5])
            signals.append(
                Signal(
                    "failed_validation", f"not supported by its citations ({missing})", UNGROUNDED
                )
            )
        elsewhere = grounding.off_subject(question, cited.citations, evidence.items)
        if elsewhere is not None:
            signals.append(
                Signal(
                    "failed_validation",
                    f"its citations do not name {', '.join(elsewhere.keys[:5])}, which "
                    f"{', '.join(elsewhere.markers)} does",
                    UNGROUNDED,
                )
            )
    given = _numbers(answer)
    if given_parts == 1 and len(given) == 1 and len(cited.citations) > 1:
        # The answer's number must be what every cited passage says, not one of several.
        disagreeing = [i.marker for i in cited.citations if given.isdisjoint(_numbers(i.text))]
        if disagreeing:
            signals.append(
                Signal(
                    "conflicting_evidence", f"{', '.join(disagreeing)} say otherwise", CONFLICTING
                )
            )
    return signals
