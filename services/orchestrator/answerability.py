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

from ragline.words import has_han
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


def _stem(word: str) -> str:
    """A light English normalisation, enough to match "rivers" with "river" and "Poland's"
    with "Poland" (full stemming would join words the question keeps apart)."""
    word = word.lower().removesuffix("'s")
    for suffix, keep in (("ies", "y"), ("sses", "ss"), ("es", "e"), ("s", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            return word[: -len(suffix)] + keep
    return word


def terms(text: str) -> list[str]:
    """The content terms of `text`, normalised."""
    return [_stem(w) for w in ev.content_words(text)]


def key_terms(question: str) -> list[str]:
    """Names, numbers and acronyms of the question: capitalised words after its first word,
    and words holding digits."""
    found = []
    for position, match in enumerate(_TOKEN.finditer(question)):
        word = match.group(0)
        lowered = word.lower()
        if lowered in _NOT_KEY:
            continue
        if any(c.isdigit() for c in word) or (position > 0 and word[0].isupper()):
            found.append(_stem(word))
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class Signals:
    similarity: float | None  # None: no sentence was embedded
    coverage: float
    key_terms: float  # 1.0 when the question has none
    key_count: int
    # The fit that judges them: the embedding model's family, or LEXICAL_GATE.
    gate: str = LEXICAL_GATE

    @property
    def probability(self) -> float:
        """The model's estimate that the evidence answers the question."""
        if self.similarity is None or self.gate not in FITTED:
            return LEXICAL.probability((self.coverage, self.key_terms))
        return FITTED[self.gate].probability((self.similarity, self.coverage, self.key_terms))

    def as_dict(self) -> dict[str, float | None]:
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
    similarities: Sequence[float] | None,
    embedding_model: str = "",
    sentences: Sequence[str] = (),
) -> Signals:
    """The signals of `question` against the candidate passages (the ones whose sentences
    competed for the prompt) and the cosines of the sentences that were embedded (None:
    none could be) by `embedding_model` ("name@version"; the gate is the one fitted to it).
    `sentences`: the texts of those cosines, in order (a Chinese pair is read on the scale
    the fit knows)."""
    asked = list(dict.fromkeys(terms(question)))
    bags = [set(terms(f"{p.title} {p.text}")) for p in passages]
    coverage = 0.0
    if asked and bags:
        # Rarity among the candidates: a term every passage has tells them apart from nothing.
        weight = {t: math.log(1 + (1 + len(bags)) / (1 + sum(t in b for b in bags))) for t in asked}
        total = sum(weight.values())
        coverage = max(sum(weight[t] for t in asked if t in bag) / total for bag in bags)
    keys = key_terms(question)
    found = set().union(*bags) if bags else set()
    key_share = sum(k in found for k in keys) / len(keys) if keys else 1.0
    if similarities is None:
        return Signals(None, coverage, key_share, len(keys))
    family = family_of(embedding_model)
    offset = FITTED[family].chinese_offset if family in FITTED and has_han(question) else 0.0
    if offset and sentences:
        similarities = [
            float(x) + (offset if has_han(text) else 0.0)
            for x, text in zip(similarities, sentences, strict=True)
        ]
    best = max((float(x) for x in similarities), default=0.0)
    return Signals(best, coverage, key_share, len(keys), family)
