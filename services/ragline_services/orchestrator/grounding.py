"""Is an answer supported by the passages it cites? A checkable test, no model: the
answer's numbers, names and content words must be found in the cited text (the sentences
the prompt held under that marker, and the passage's title), or their translation where
the answer and its citation are written in different languages (`ragline.lexicon`), each
part of a several-part answer against its own citations.

An answer is built to be short ("a few words copied from the evidence"), so copying is
what is checked: every number exactly, and at least `MIN_WORD_SHARE` of the content words
it adds to the question (light stemming: "rivers" matches "river", "feet" "foot"; Chinese as the
character bigrams of its words, `ragline.words`); the question's own words restated are
not its claim, and an answer of nothing else is an echo unless it chooses one of the
alternatives the question offers. A bare yes or no copies nothing; it is
supported when the cited text holds the question's own terms (it speaks of what was asked).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ragline import numbers, units
from ragline.words import has_han, mostly_han, place_root, singular
from ragline_services.orchestrator import answerability
from ragline_services.orchestrator import evidence as ev

# Share of an answer's content words its cited text must hold. Measured on SQuAD dev
# answers of the small model (tools/bench_e2e.py): see docs/answer-states.md.
MIN_WORD_SHARE = 0.75
# Share of the question's terms a yes/no answer's cited text must hold.
MIN_QUESTION_SHARE = 0.5

_YES_NO = frozenset({"yes", "no"})
_WORD = re.compile(r"[a-z0-9_]+")


@dataclass(frozen=True)
class Support:
    supported: bool
    # What the cited text lacks (numbers and words), for the reason a caller reads.
    missing: tuple[str, ...] = ()


def support(answer: str, cited: Sequence[ev.EvidenceItem], question: str = "") -> Support:
    """Whether `answer` (markers allowed) is supported by `cited`."""
    # A number's unit is read by its name on both sides: "3 seconds" is copied from "3s".
    text = units.spelled_out(ev.strip_markers(answer))
    if not cited:
        return Support(False, ("a citation",))
    source = units.spelled_out(
        " ".join(f"{ev.shown_title(item.passage)} {item.text}" for item in cited)
    )
    read = answerability.Text.of(source)
    source_terms = read.terms
    words = [w.lower() for w in ev.content_words(text)]
    asked = set(answerability.terms(question)) if question else set()
    if words and set(words) <= _YES_NO and question:
        share = len(asked & source_terms) / len(asked) if asked else 0.0
        return Support(
            share >= MIN_QUESTION_SHARE,
            () if share >= MIN_QUESTION_SHARE else ("the question's terms",),
        )
    chosen = bool(question) and names_an_alternative(text, question)
    given = numbers.numbers(text)
    if question and not given - numbers.numbers(question):
        told = set(answerability.terms(text)) - asked
        if words and not told and not _names_code(text, question) and not chosen:
            # "The river flows through Warsaw." names nothing the question did not.
            return Support(False, ("anything the question does not already say",))
    missing_numbers = sorted(given - numbers.numbers(source))
    # Numbers were checked above, however written ("two" is the number 2, not a word;
    # "hundreds" is a word, no number).
    counted = [t for t in answerability.translated_terms(text) if not _a_number(t.term, given)]
    # The question's words restated are not the answer's claim: what it adds must be copied
    # ("The main factor is the degree of bending": "degree", "bending"). A choice among
    # the question's alternatives is its claim whole.
    added = [t for t in counted if t.term not in asked]
    if added and not chosen:
        counted = added
    # A Chinese term is copied when the cited text holds its characters (jieba may have
    # cut the passage around them otherwise: "全长约" is one word there, "约" one here); a
    # word of the other language when the cited text holds a translation of it ("the East
    # China Sea" from "注入东海").
    singulars = {singular(term) for term in source_terms}
    missing_words = [
        t.term
        for t in counted
        if not (
            t.found_in(read)
            or singular(t.term) in singulars
            or (has_han(t.term) and t.term in source)
        )
    ]
    share = 1.0 - len(missing_words) / len(counted) if counted else 1.0
    if not counted and not given:
        if ev.literal_in(text, source):
            return Support(True)  # a literal copied as written ("'+'", "**")
        # Nothing checkable (punctuation, a lone stop word): not an answer to stand on.
        return Support(False, ("any content word",))
    ok = not missing_numbers and share >= MIN_WORD_SHARE
    return Support(ok, () if ok else tuple(missing_numbers + missing_words))


def recited(
    answer: str, cited: ev.Cited, items: Sequence[ev.EvidenceItem], question: str
) -> tuple[str, ev.Cited] | None:
    """The answer and its citation with its one marker moved to the passage that holds it,
    where the passage it names does not and exactly one other passage of the prompt does
    (naming what the question asks about): the model wrote the wrong number ("Lagos and
    Quiberon Bay [2]", copied from [1]). None where that is not so."""
    if len(cited.citations) != 1 or support(answer, cited.citations, question).supported:
        return None
    holding = [
        item
        for item in items
        if item not in cited.citations
        and support(answer, [item], question).supported
        and off_subject(question, [item], items) is None
    ]
    if len(holding) != 1:
        return None
    (named,), (found,) = cited.citations, holding
    return answer.replace(named.marker, found.marker), ev.Cited([found], cited.dropped)


def says_the_same(first: str, second: str) -> bool:
    """Whether two answers to one question, in different languages, say the same thing:
    either one's numbers and words are found in the other, through the lexicon ("193公里"
    and "193 kilometers"; "皮肤" and "Skin (16%)"). Answers in one language compare by
    `ragline.answer_match.same_answer`."""
    if mostly_han(first) == mostly_han(second):
        return False
    return any(
        support(claim, [ev.EvidenceItem("[1]", ev.Passage("", "", held), held)]).supported
        for claim, held in ((first, second), (second, first))
    )


def _a_number(term: str, given: set[str]) -> bool:
    """Whether `term` is one of the answer's numbers (`given`): digits, or a number word
    whose value the answer gives ("two"; "hundreds" gives none)."""
    value = numbers.numbers(term)
    return bool(value) and (term[:1].isdigit() or value <= given)


def alternatives(question: str) -> list[set[str]]:
    """The terms of each alternative a question offers to choose from, or [] where it
    offers none: "growth or reduction?"; "..., the male or female?"; "Who voted for Bush
    more: weekly church-goers, occasional church-goers, or those who never attend?" (a list
    with a comma before its "or" runs back to the colon or the question's own clause)."""
    head, sep, tail = question.strip().rstrip("?").rpartition(" or ")
    if not sep:
        return []
    last = re.split(r"[,;:]", tail)[0].split()
    if not last:
        return []
    items = [" ".join(last)]
    segments = head.rstrip().split(",")
    listed = head.rstrip().endswith(",")
    for segment in reversed(segments[:-1] if listed else segments):
        _, colon, item = segment.rpartition(":")
        words = item.split()
        if colon or (listed and len(words) <= len(last) + 2):
            items.append(item)
            if colon:
                break
            continue
        # The question's own clause ends with the first alternative: as many words as the
        # last one has.
        items.append(" ".join(words[-len(last) :]))
        break
    return [found for found in (set(answerability.terms(i)) for i in items) if found]


def names_an_alternative(answer: str, question: str) -> bool:
    """Whether `answer` chooses one of the alternatives `question` offers (its words all of
    one of them, and of no other alone): "growth" for "growth or reduction?" says what no
    word of the question does, though it is one."""
    said = set(answerability.terms(answer))
    if not said:
        return False
    holding = [terms for terms in alternatives(question) if said <= terms]
    return len(holding) == 1


def _names_code(answer: str, question: str) -> bool:
    """Whether the answer writes an identifier of code that the question writes neither as
    it is nor as one of its words: "--verify" for "Which option verifies ...?" names a
    thing the question asks for, though its stem is the question's. "METHOD" for "Which
    method ...?" stays an echo (a placeholder of the page as often as a name: measured in
    docs/answer-states.md). A question for a variable or a constant is answered by a name
    in capitals, which is how they are written, though it is the program's name
    ("LESS" for "Which environment variable holds options for less?")."""
    asked = set(_WORD.findall(question.lower()))
    tokens = [t.strip(".,;:\"'`") for t in answer.split()]
    if _ASKS_FOR_A_VARIABLE.search(question) and any(
        _IN_CAPITALS.fullmatch(token) and token not in question for token in tokens
    ):
        return True
    return any(
        ev.looks_like_code(token)
        and token not in question
        and token.lstrip("-").lower() not in asked
        for token in tokens
    )


_ASKS_FOR_A_VARIABLE = re.compile(r"\b(variable|constant)s?\b", re.IGNORECASE)
_IN_CAPITALS = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*")


def _names(term: answerability.Term, text: answerability.Text) -> bool:
    """Whether `text` names `term`, its place for an adjective of place too: the Victorian
    cabinet's passage is titled "Victoria (Australia)"."""
    if term.found_in(text):
        return True
    root = place_root(term.term)
    return root != term.term and any(place_root(held) == root for held in text.terms)


@dataclass(frozen=True)
class OffSubject:
    """An answer whose citations do not name what the question asks about, while other
    evidence does: "Into which sea does the Yangtze flow?" answered from the Yellow River's
    passage (its words are there, so it is supported, and wrong)."""

    keys: tuple[str, ...]  # the question's key terms its citations lack
    markers: tuple[str, ...]  # the uncited evidence that holds them


def off_subject(
    question: str, cited: Sequence[ev.EvidenceItem], evidence: Sequence[ev.EvidenceItem]
) -> OffSubject | None:
    """None unless the cited passages lack a key term of the question (a name, a number; in
    either language) that the shown text of an uncited evidence passage holds."""
    keys = answerability.key_terms(question)
    if not keys or not cited:
        return None
    translated = {t.term: t for t in answerability.translated_terms(question)}
    asked = [translated.get(k, answerability.Term(k)) for k in keys]

    def read(item: ev.EvidenceItem) -> answerability.Text:
        return answerability.Text.of(f"{ev.shown_title(item.passage)} {item.text}")

    # The cited passage whole: the sentences shown may not repeat its subject ("It was
    # dropped in 1964" of the Lunar Module's passage).
    cited_text = [
        answerability.Text.of(f"{ev.shown_title(item.passage)} {item.passage.text}")
        for item in cited
    ]
    lacking = [t for t in asked if not any(_names(t, text) for text in cited_text)]
    if not lacking:
        return None
    others = [(item.marker, read(item)) for item in evidence if item not in cited]
    holding = {t.term: [marker for marker, text in others if _names(t, text)] for t in lacking}
    named = {term: markers for term, markers in holding.items() if markers}
    if not named:
        return None
    markers = sorted({m for found in named.values() for m in found})
    return OffSubject(tuple(named), tuple(markers))
