"""The verifier's second read: when the cited text holds other candidates of the answer's
kind (other options of a list, other constants, other dates), the small model is asked
once more, to choose among them, the answer's cited text as its evidence. An answer the
second read does not choose again is `unverified` (and the candidate it chose is named).
Choosing among written options is an easier task for a small model than finding the span,
and the prompt is a fraction of the answer's (one passage, no other evidence).

Pure: the prompt and the reading of the reply; the call is the answer step's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ragline_services.orchestrator import evidence as ev

# Bump with the prompt (the answer cache keys on the verifier's version, which names it).
SYSTEM_PROMPT = (
    "Choose the option that answers the question, reading the evidence. Reply with the "
    "option's letter only."
)
LETTERS = "ABCDE"
# At most this many options: the answer and its two closest rivals. More options made the
# small model's choice a lottery (docs/tuning.md).
MAX_OPTIONS = 3
_LETTER = re.compile(r"\b([A-E])\b")


@dataclass(frozen=True)
class Options:
    """The options as asked: texts in the order they stand in the evidence (so the answer
    is not always the first), and which one is the answer."""

    texts: tuple[str, ...]
    answer: int


def options(answer: str, rivals: tuple[str, ...], evidence_text: str) -> Options:
    """The answer and up to MAX_OPTIONS - 1 rivals, in the order they appear in the text."""
    picked = [answer, *[r for r in rivals if r.lower() != answer.lower()][: MAX_OPTIONS - 1]]
    lowered = evidence_text.lower()

    def position(text: str) -> int:
        found = lowered.find(text.lower())
        return found if found >= 0 else len(lowered)

    ordered = sorted(picked, key=position)
    return Options(tuple(ordered), ordered.index(answer))


def user_message(question: str, evidence_text: str, asked: Options) -> str:
    lines = ["Evidence:", ev.as_data(evidence_text), "", f"Question: {question}", "Options:"]
    lines += [f"{LETTERS[i]}) {ev.as_data(text)}" for i, text in enumerate(asked.texts)]
    return "\n".join(lines)


def chosen(reply: str, asked: Options) -> int | None:
    """The option the reply names (its letter, or its text), None when it names none."""
    found = _LETTER.search(reply.strip()[:8])
    if found and LETTERS.index(found.group(1)) < len(asked.texts):
        return LETTERS.index(found.group(1))
    written = reply.strip().lower()
    for index, text in enumerate(asked.texts):
        if written and written.startswith(text.lower()):
            return index
    return None
