"""A follow-up question read with the subject it refers back to.

A chat client sends its conversation with each question. "And when was it built?" names
nothing to search for; the user turn it follows ("Tell me about Sigismund's Column") does.
A question that refers back (a pronoun or demonstrative standing for something, an opening
"and"/"what about", a Chinese 它/其/这/那) is read as itself plus, in parentheses, the
content words of that turn it does not hold already: every step then sees the subject
(retrieval, the gate, the prompt, the verifier). A question that stands alone is read as it
is, whatever came before, so a new subject never drags the old one in. Only user turns are
read: an assistant's answer may be wrong, and is the service's own text.

A rule, not a model call: it costs nothing on the critical path, and what it did is in the
answer's route detail.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ragline.stopwords import STOP_WORDS
from ragline.words import HAN, han_words, has_han, stem

# Words that stand for something named before (English), at a word boundary.
_REFERRING = re.compile(
    r"\b(it|its|it's|they|them|their|theirs|this|that|these|those|he|him|his|she|her|hers|"
    r"there|then|the same|the former|the latter|one)\b",
    re.IGNORECASE,
)
# An opening that continues the previous question ("and ...", "what about ...").
_CONTINUING = re.compile(r"^\s*(and|also|what about|how about|and what about|or)\b", re.I)
_REFERRING_HAN = ("它", "其", "这", "那", "他", "她", "该")
# Content words of the earlier turn carried over: a subject, not the turn's whole text.
MAX_SUBJECT_WORDS = 8
_HAN_GAP = re.compile(r"(?<=[\u3400-\u9fff]) (?=[\u3400-\u9fff])")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'_.-]*")


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
    text: str


@dataclass(frozen=True)
class Resolved:
    question: str
    # The subject carried over ("" when the question stands alone).
    subject: str = ""


def refers_back(question: str) -> bool:
    if has_han(question) and any(mark in question for mark in _REFERRING_HAN):
        return True
    return bool(_REFERRING.search(question) or _CONTINUING.search(question))


def _content_words(text: str) -> list[str]:
    words = [w.strip(".'-") for w in _WORD.findall(text)]
    latin = [w for w in words if w and w.lower() not in STOP_WORDS and not w.isdigit()]
    return latin + [w for run in HAN.findall(text) for w in han_words(run)]


def _subject(turn: str, question: str) -> list[str]:
    asked = {stem(w) for w in _content_words(question)}
    seen: set[str] = set()
    subject: list[str] = []
    for word in _content_words(turn):
        key = stem(word)
        if key in asked or key in seen or key in _ASKING:
            continue
        seen.add(key)
        subject.append(word)
    return subject[:MAX_SUBJECT_WORDS]


# Words of a request rather than of its subject ("tell me about X", "explain X").
_ASKING = frozenset(
    "tell explain describe know want like please give show say talk question ask".split()
)


# The subject `resolve` carries, as it writes it after the question.
_CARRIED = re.compile(r"\s*\([^()]*\)\s*$")


def without_subject(question: str) -> str:
    """`question` without a subject `resolve` carried into it (what a model is asked to
    answer: it would copy the subject's words otherwise)."""
    return _CARRIED.sub("", question) or question


def resolve(question: str, conversation: Sequence[Turn]) -> Resolved:
    """The question to answer: `question` itself, or with the subject of the last user turn
    when it refers back to it."""
    last_user = next((t.text for t in reversed(conversation) if t.role == "user"), "")
    if not last_user.strip() or not refers_back(question):
        return Resolved(question)
    subject = _subject(last_user, question)
    if not subject:
        return Resolved(question)
    # Chinese words run together, any other word stands apart.
    joined = _HAN_GAP.sub("", " ".join(subject))
    return Resolved(f"{question.rstrip()} ({joined})", joined)
