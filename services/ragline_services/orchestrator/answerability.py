"""Can the evidence answer the question? Decided before generation from signals the plan
already has, so a question the documents do not cover ends INCOMPLETE at once: no model
call, no model budget, no escalation (a larger model cannot read what was never ingested).

Pure functions here. The signals:
- `similarity`: the best cosine between the question's embedding and one candidate
  sentence's (the stack's own embedding model, computed for evidence selection anyway);
- `coverage`: the share of the question's content terms, weighted by how rare they are
  among the candidate passages, that the best single passage (title + text) contains;
- `key_terms`: the share of the question's key terms (names, numbers, words in capitals
  or with digits) that some candidate passage contains: a question about "the 2030 FIFA
  World Cup" is not answered by a passage about another year's cup.

They are combined by a logistic model whose weights were fitted on shared evaluation data
(`tools/calibrate_gate.py`: questions over ingested articles against questions whose
article was held out, and another collection's questions); the threshold on its
probability is a setting.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragline import lexicon
from ragline.words import (
    bigrams,
    english_terms,
    han_words,
    has_han,
    mostly_han,
    segmenter,
    stem,
)
from ragline_services.orchestrator import evidence as ev
from ragline_services.orchestrator.runner import Abstain

NO_RELEVANT_EVIDENCE = "no_relevant_evidence"


@dataclass(frozen=True)
class GateModel:
    """A logistic model over signals: one weight per signal, in order, and a bias."""

    weights: tuple[float, ...]
    bias: float
    # Added to the cosine of a Chinese question and a Chinese sentence before it is read:
    # a multilingual model scores such pairs higher than English ones of the same kind, and
    # the weights were fitted on English.
    chinese_offset: float = 0.0

    def probability(self, values: Sequence[float]) -> float:
        z = self.bias + sum(w * x for w, x in zip(self.weights, values, strict=True))
        return 1 / (1 + math.exp(-z))


# The logistic model over (similarity, coverage, key_terms), one per embedding model family:
# `similarity` is that model's cosine, and its scale is the model's own (a question and an
# unrelated sentence score ~0.3 with MiniLM, ~0.75 with multilingual-e5). Builds of one model
# (fp32, int8, 4-bit) share its scale and its fit. Each is fitted by `tools/calibrate_gate.py`
# on SQuAD dev alone (every 4th article held out; 600 answerable against 600 unanswerable
# questions, seed 11) with the default stack of its time; new_wiki and the Chinese set are
# the held-out checks. Figures: docs/answer-states.md.
FITTED: dict[str, GateModel] = {
    "minilm-l6": GateModel((18.417, 4.433, 1.288), -13.234),
    # Chinese pairs: -0.067, the gap between the median best cosine of a question and an
    # unrelated passage's sentences, Chinese set 0.817 against SQuAD dev / new_wiki 0.748 /
    # 0.753 (150 questions each; no answer labels read). Fitted instead on the Chinese
    # set's answerable and unanswerable questions it comes out at 0.060 / 0.075 on either
    # half (by article) and 0.070 on all.
    "me5-small": GateModel((70.462, 6.232, 0.877), -63.121, chinese_offset=-0.067),
}
# Without the similarity (the embedding service down: evidence chosen by words alone; or an
# embedding model no fit above knows), the same fit over (coverage, key_terms). Weaker: at
# 0.25 it lets through 39% of SQuAD dev's unanswerable questions (the full model 15%).
LEXICAL = GateModel((7.804, 2.189), -5.564)
LEXICAL_GATE = "lexical"
# The same words-alone fit, where the closest sentence or the passage holding most of the
# question's words is in the other language (terms matched through `ragline.lexicon`).
CROSS_LINGUAL_GATE = "cross-lingual"


def family_of(model_version: str) -> str:
    """The fitted family an embedding model ("name@sha256") belongs to, else LEXICAL_GATE:
    its cosines have no calibrated meaning here."""
    name = model_version.split("@", 1)[0]
    for family in FITTED:
        if name == family or name.startswith(family + "-"):
            return family
    return LEXICAL_GATE


# Words that open a sentence or name nothing, even in capitals.
_NOT_KEY = ev.STOPWORDS | frozenset(
    """i you he she we it if name give list tell explain describe according""".split()
)
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-]*")


def terms(text: str) -> list[str]:
    """The content terms of `text`, normalised."""
    return [stem(w) for w in ev.content_words(text)]


def the_lexicon() -> lexicon.Lexicon | None:
    """The Chinese-English lexicon (None without its package)."""
    return lexicon.shared()


def warm(cache_dir: Path | None = None) -> None:
    """Loads what reading Chinese needs (blocking; at start, off the event loop)."""
    segmenter()
    lexicon.shared(cache_dir)


@dataclass(frozen=True)
class Text:
    """A text as the word checks read it: its content terms, the last characters of its
    Chinese words (Chinese compounds end with what they are: 东海 is a 海, a sea; 长江 a
    江, a river), and the text itself."""

    terms: frozenset[str]
    heads: frozenset[str]
    raw: str

    @classmethod
    def of(cls, text: str) -> Text:
        chinese = han_words(text) if has_han(text) else []
        english = english_terms(text)
        held = english + [term for word in chinese for term in bigrams(word)]
        return cls(frozenset(held), frozenset(word[-1] for word in chinese), text)


@dataclass(frozen=True)
class Term:
    """One content term of a text, with what says it in the other language: the Chinese
    words that translate an English term (in that text's context), or the glosses of the
    Chinese word a Chinese term comes from."""

    term: str
    chinese: frozenset[str] = frozenset()
    english: tuple[frozenset[str], ...] = ()

    def found_in(self, text: Text) -> bool:
        """Whether `text` holds this term, in either language. A Chinese translation of two
        characters or more is looked up in the text itself (jieba may cut it apart there:
        "注入东海" is one word); a one-character one only as the end of a word of its own
        (海 in 东海, never 海 inside 海关: one character is inside too many other words)."""
        if self.term in text.terms:
            return True
        if any((c in text.raw) if len(c) > 1 else (c in text.heads) for c in self.chinese):
            return True
        return any(gloss <= text.terms for gloss in self.english)


def translated_terms(text: str) -> list[Term]:
    """The content terms of `text` (as `terms` makes them, once each), each with its
    translations from the lexicon (none without it)."""
    found: dict[str, Term] = {}
    english = english_terms(text)
    table = the_lexicon() if english or has_han(text) else None
    context = frozenset(english)
    for term in english:
        if term not in found:
            chinese = frozenset(table.chinese(term, context)) if table else frozenset()
            found[term] = Term(term, chinese)
    for word in han_words(text) if has_han(text) else ():
        glosses = tuple(table.english(word)) if table else ()
        for term in bigrams(word):
            known = found.get(term)
            found[term] = Term(term, english=glosses + (known.english if known else ()))
    return list(found.values())


def key_terms(question: str) -> list[str]:
    """Names, numbers and acronyms of the question: capitalised words after its first word,
    words holding digits, and Chinese words of two characters or more the lexicon knows as
    names (as their terms: character bigrams)."""
    found = []
    for position, match in enumerate(_TOKEN.finditer(question)):
        word = match.group(0)
        lowered = word.lower()
        if lowered in _NOT_KEY:
            continue
        if any(c.isdigit() for c in word) or (position > 0 and word[0].isupper()):
            found.append(stem(word))
    table = the_lexicon() if has_han(question) else None
    if table is not None:
        # One character is a name too often to mean one (中: China, and "in").
        found += [
            t
            for word in han_words(question)
            if len(word) > 1 and table.is_name(word)
            for t in bigrams(word)
        ]
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Signals:
    similarity: float | None  # None: no sentence was embedded
    coverage: float
    key_terms: float  # 1.0 when the question has none
    key_count: int
    # The fit that judges them: the embedding model's family, or LEXICAL_GATE (no fit knows
    # its cosines), or CROSS_LINGUAL_GATE (words alone, across languages).
    gate: str = LEXICAL_GATE

    @property
    def probability(self) -> float:
        """The model's estimate that the evidence answers the question."""
        if self.similarity is None or self.gate not in FITTED:
            return LEXICAL.probability((self.coverage, self.key_terms))
        return FITTED[self.gate].probability((self.similarity, self.coverage, self.key_terms))

    def as_dict(self) -> dict[str, float | str | None]:
        return {
            "similarity": None if self.similarity is None else round(self.similarity, 4),
            "coverage": round(self.coverage, 4),
            "key_terms": round(self.key_terms, 4),
            "key_count": self.key_count,
            "gate": self.gate,
            "probability": round(self.probability, 4),
        }


class NotAnswerable(Abstain):
    """The gate's decision: the evidence plainly does not answer the question (or the
    part of it named)."""

    def __init__(self, found: Signals, threshold: float, part: str = "") -> None:
        what = f"the part {part!r} of the question" if part else "the question"
        super().__init__(
            NO_RELEVANT_EVIDENCE,
            f"no passage visible to this caller is relevant enough to answer {what} "
            f"(answerability {found.probability:.2f} < {threshold:.2f}: "
            + (
                "no sentence could be embedded"
                if found.similarity is None
                else f"best sentence similarity {found.similarity:.2f}"
                if found.gate in FITTED
                else "judged by words alone, through the Chinese-English lexicon: the closest "
                "sentence is in another language than the question"
                if found.gate == CROSS_LINGUAL_GATE
                else "judged by words alone: no gate is fitted to the embedding model"
            )
            + f", question terms covered {found.coverage:.0%}, key terms found "
            f"{found.key_terms:.0%}); nothing was generated",
        )
        self.signals = found


def gate(found: Signals, threshold: float, *, part: str = "") -> None:
    """Raises NotAnswerable when the estimate is below `threshold` (0 lets all through)."""
    if found.probability < threshold:
        raise NotAnswerable(found, threshold, part)


def signals(
    question: str,
    passages: Sequence[ev.Passage],
    similarities: Sequence[float] | np.ndarray | None,
    embedding_model: str = "",
    sentences: Sequence[str] = (),
) -> Signals:
    """The signals of `question` against the candidate passages (the ones whose sentences
    competed for the prompt) and the cosines of the sentences that were embedded (None:
    none could be) by `embedding_model` ("name@version"; the gate is the one fitted to it).
    `sentences`: the texts of those cosines, in order (a Chinese pair is read on the scale
    the fit knows)."""
    asked = translated_terms(question)
    read = [Text.of(f"{p.title} {p.text}") for p in passages]
    bags = [text.terms for text in read]
    # found[i][j]: passage j holds asked term i, in either language.
    found = [[t.found_in(text) for text in read] for t in asked]
    coverage, best_covered = 0.0, None
    if asked and bags:
        # Rarity among the candidates: a term every passage has tells them apart from nothing.
        weight = [math.log(1 + (1 + len(bags)) / (1 + sum(row))) for row in found]
        total = sum(weight)
        shares = [
            sum(w for w, row in zip(weight, found, strict=True) if row[j]) / total
            for j in range(len(bags))
        ]
        coverage = max(shares)
        best_covered = read[shares.index(coverage)].raw if coverage > 0 else None
    keys = key_terms(question)
    by_term = {t.term: any(row) for t, row in zip(asked, found, strict=True)}
    # A key the content terms spell otherwise ("COVID-19") is looked up as it is.
    held = [by_term[k] if k in by_term else any(k in bag for bag in bags) for k in keys]
    key_share = sum(held) / len(keys) if keys else 1.0
    if similarities is None:
        return Signals(None, coverage, key_share, len(keys))
    family = family_of(embedding_model)
    offset = FITTED[family].chinese_offset if family in FITTED and has_han(question) else 0.0
    if offset and sentences:
        similarities = [
            float(x) + (offset if has_han(text) else 0.0)
            for x, text in zip(similarities, sentences, strict=True)
        ]
    scores = [float(x) for x in similarities]
    best = max(scores, default=0.0)
    if sentences and family in FITTED:
        asked_in = mostly_han(question)
        closest = sentences[scores.index(best)]
        if mostly_han(closest) != asked_in or (
            best_covered is not None and mostly_han(best_covered) != asked_in
        ):
            # The closest sentence, or the passage holding most of the question's words, is
            # in the other language: a cosine across languages has no meaning the fit knows
            # (multilingual-e5-small scores a question and the sentence in the other
            # language that answers it about as high as a question and an unrelated
            # sentence in its own), so the words decide, read through the lexicon.
            family = CROSS_LINGUAL_GATE
    return Signals(best, coverage, key_share, len(keys), family)
