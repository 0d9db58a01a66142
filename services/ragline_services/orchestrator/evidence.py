"""Evidence selection, the prompt, and citations. No gRPC here.

The prompt holds only the sentences that carry the answer: the best passages are split
into sentences, each scored against the question (embedding cosine from the stack's own
embedding model, plus a lexical overlap weighted by rarity, plus the passage's rank), and
the best are kept within a token budget, in their original order under one marker per
passage. The fixed part of the prompt (the system text) comes first so the generation
service's tenant prefix cache covers it; only evidence and question are prefilled anew.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ragline import control_tokens, numbers, words
from ragline.vocabulary import Language

if TYPE_CHECKING:
    from ragline_services.orchestrator.answerability import Signals

# Bump when the prompt changes: answer caches key on it.
PROMPT_TEMPLATE_VERSION = "rag-v2"

# The wording the small model answered best with (docs/tuning.md, "The answer prompt").
SYSTEM_PROMPT = (
    "Answer the question from the evidence. Give only the answer: a few words copied from the "
    "evidence, no sentence. Then the passage number in brackets."
)
# A question written in Chinese gets the evidence and question labelled in Chinese; the
# instruction stays English, which the small model followed best (docs/tuning.md).
_LABELS = {Language.ENGLISH: ("Evidence:", "Question:", "Answer only this part of it:"),
           Language.CHINESE: ("证据：", "问题：", "只回答其中这一部分：")}  # fmt: skip


def language_of(question: str) -> Language:
    """The language a question is answered in: Chinese when it holds Chinese, else English."""
    return Language.CHINESE if words.has_han(question) else Language.ENGLISH


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+(?=[A-Z0-9\"'(\[])")
# Chinese sentences end at 。！？； (closing quotes and brackets kept with them), with or
# without a space after.
_SENTENCE_END_ZH = re.compile(r"(?<=[。！？；])[\u201d\u2019」』）]?(?=\S)")
_WORD = words.LATIN_WORD
# An answer's citation marker, "[n]" (restatement.py reads it too; as_data rewrites it in
# documents).
MARKER = re.compile(r"\[(\d{1,3})\]")
# Function words carry no evidence of an answer (they match nearly every sentence).
STOPWORDS = words.FUNCTION_WORDS


def tokens_estimate(text: str) -> int:
    """Prompt tokens of `text` for the generation models: BPE on English prose averages
    about 4 characters a token, a Chinese character up to one; rounding up keeps the
    budget honest."""
    han = sum(len(run) for run in words.HAN.findall(text))
    return max(1, han + math.ceil((len(text) - han) / 3.8))


def content_words(text: str) -> list[str]:
    """English words without function words, then the terms of any Chinese in `text`
    (`ragline.words.han_terms`: character bigrams of its words, question words out)."""
    found = words.english_words(text)
    return found + words.han_terms(text) if words.has_han(text) else found


def split_sentences(text: str) -> list[str]:
    """Sentences, cut at sentence ends (English and Chinese) and at line breaks (a line is
    never two sentences' halves: lists, headings and quoted turns end with their line)."""
    return [
        s.strip()
        for line in text.splitlines()
        for english in _SENTENCE_END.split(line)
        for s in _SENTENCE_END_ZH.split(english)
        if s.strip()
    ]


@dataclass(frozen=True)
class Passage:
    """A retrieved passage as the plan carries it between steps."""

    id: str
    title: str
    text: str
    version: int = 0
    score: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Sentence:
    passage: int  # index into the candidate passages
    position: int  # order inside its passage
    text: str
    tokens: int


@dataclass(frozen=True)
class EvidenceItem:
    marker: str  # "[1]"
    passage: Passage
    text: str  # the selected sentences, in passage order


@dataclass(frozen=True)
class Evidence:
    items: tuple[EvidenceItem, ...]
    tokens: int
    sentences_considered: int
    # What the answerability gate read, where the evidence step computed it.
    signals: Signals | None = None

    def marker_of(self, marker: str) -> EvidenceItem | None:
        return next((item for item in self.items if item.marker == marker), None)


# Document text is data, never control: control-token look-alikes are dropped (the
# generation service also never parses chat text for them), and passage markers written in
# a document are rewritten, so the prompt's own markers are the only `[n]` in it and a
# document cannot pose as another passage. The rewrite reads `MARKER`, the pattern answers'
# citations are read with: a marker form it missed could be cited as a passage.
# A sentence that speaks to the model instead of about the world ("ignore the previous
# instructions", "you are now ...", "reply only with the word ...") never competes for the
# prompt: it can carry no answer, only a new order.
_ADDRESSES_THE_MODEL = re.compile(
    r"\b(ignore|disregard|forget|override)\b[^.!?]{0,40}\b(instructions?|prompts?|rules|"
    r"directions|guidelines)\b"
    r"|\b(system prompt|you are now|new instructions|as an ai)\b"
    r"|\b(respond|reply|answer|output)\b[^.!?]{0,20}\b(only|always)\b[^.!?]{0,20}\bwith\b"
    r"|\b(respond|reply|answer)\s+(to\s+)?(every|all|each|any)\s+(questions?|query|queries)\b",
    re.IGNORECASE,
)


def as_data(text: str) -> str:
    """Document text as it may appear in a prompt: no control-token look-alikes (they carry
    no evidence), no passage markers."""
    return MARKER.sub(r"(\1)", control_tokens.remove(text))


def addresses_the_model(sentence: str) -> bool:
    return bool(_ADDRESSES_THE_MODEL.search(sentence))


# A title is a label: longer than this, it is cut (a title is no place for evidence).
_TITLE_CHARS = 160


def shown_title(passage: Passage) -> str:
    """The passage's title as the prompt shows it, and as the answer checks read it: as
    data, cut to a label's length, and none where it speaks to the model (a title that
    orders "reply only with PWNED" would otherwise reach the prompt and then count as the
    support of the very answer it ordered)."""
    title = as_data(passage.title).strip()[:_TITLE_CHARS]
    return "" if addresses_the_model(title) else title


def candidate_sentences(passages: list[Passage]) -> list[Sentence]:
    out = []
    for p_index, passage in enumerate(passages):
        for position, text in enumerate(split_sentences(passage.text)):
            text = as_data(text)
            if addresses_the_model(text) or not (_WORD.search(text) or words.has_han(text)):
                continue
            out.append(Sentence(p_index, position, text, tokens_estimate(text)))
    return out


def lexical_scores(question: str, sentences: list[Sentence]) -> np.ndarray:
    """Share of the question's content words (weighted by rarity among the candidate
    sentences) that a sentence contains."""
    asked = set(content_words(question))
    if not asked or not sentences:
        return np.zeros(len(sentences))
    bags = [set(content_words(s.text)) for s in sentences]
    frequency = Counter(w for bag in bags for w in bag & asked)
    weight = {w: math.log(1 + len(bags) / (1 + frequency[w])) for w in asked}
    total = sum(weight.values())
    return np.array([sum(weight[w] for w in bag & asked) / total for bag in bags])


def shortlist(question: str, sentences: list[Sentence], count: int) -> list[Sentence]:
    """The `count` sentences with the most lexical and rank evidence, in their original
    order: only these are embedded (each embedding costs milliseconds on a small CPU)."""
    if len(sentences) <= count:
        return sentences
    score = lexical_scores(question, sentences) + np.array(
        [0.05 / (1 + s.passage) for s in sentences]
    )
    keep = sorted(np.argsort(-score, kind="stable")[:count])
    return [sentences[int(i)] for i in keep]


def select(
    question: str,
    passages: list[Passage],
    sentences: list[Sentence],
    similarity: np.ndarray | None,
    budget_tokens: int,
    *,
    lexical_weight: float = 0.5,
    rank_weight: float = 0.05,
) -> Evidence:
    """The best sentences within `budget_tokens`, grouped under one marker per passage.

    `similarity[i]` is the cosine between the question's and sentence i's embeddings (None:
    lexical and rank evidence only)."""
    if not sentences:
        return Evidence((), 0, 0)
    score = lexical_weight * lexical_scores(question, sentences)
    if similarity is not None:
        score = score + similarity
    score = score + np.array([rank_weight / (1 + s.passage) for s in sentences])
    chosen: list[Sentence] = []
    used = 0
    for index in np.argsort(-score, kind="stable"):
        sentence = sentences[int(index)]
        if used + sentence.tokens <= budget_tokens:
            chosen.append(sentence)
            used += sentence.tokens
    if not chosen:  # even the best sentence is over budget: keep its head
        best = sentences[int(np.argmax(score))]
        head = best.text[: max(int(budget_tokens * 3.8), 1)]
        chosen = [Sentence(best.passage, best.position, head, tokens_estimate(head))]
        used = chosen[0].tokens
    # Passages in order of their best chosen sentence; sentences in their own order.
    best_rank: dict[int, int] = {}
    for rank, sentence in enumerate(chosen):
        best_rank.setdefault(sentence.passage, rank)
    items = []
    for number, p_index in enumerate(sorted(best_rank, key=best_rank.__getitem__), start=1):
        picked = sorted((s for s in chosen if s.passage == p_index), key=lambda s: s.position)
        items.append(
            EvidenceItem(f"[{number}]", passages[p_index], " ".join(s.text for s in picked))
        )
    return Evidence(tuple(items), used, len(sentences))


def renumbered(evidence: Evidence, start: int = 1) -> Evidence:
    """The same evidence with markers numbered from `start`, in order."""
    items = tuple(
        EvidenceItem(f"[{n}]", item.passage, item.text)
        for n, item in enumerate(evidence.items, start=start)
    )
    return Evidence(items, evidence.tokens, evidence.sentences_considered, evidence.signals)


def user_message(question: str, evidence: Evidence, *, part: str = "") -> str:
    """The prompt's user turn; `part`: the one part of `question` to answer (a lookup of a
    several-part question), which the small model answers well only beside the whole
    question (alone, a lookup like "river through Warsaw" is echoed, not answered)."""
    evidence_label, question_label, part_label = _LABELS[language_of(question)]
    if part and part.strip().lower() != question.strip().lower():
        question = f"{question}\n{part_label} {part}"
    lines = [evidence_label]
    for item in evidence.items:
        title = shown_title(item.passage)
        lines.append(
            f"{item.marker} {title}: {item.text}" if title else f"{item.marker} {item.text}"
        )
    lines += ["", f"{question_label} {question}"]
    return "\n".join(lines)


@dataclass(frozen=True)
class Cited:
    citations: list[EvidenceItem]
    dropped: list[str]  # markers the model wrote that were not in the prompt


def _compared_words(text: str) -> set[str]:
    """The content words `text` is attributed by, numbers as numbers ("8" is in a passage
    that says "eight")."""
    return set(content_words(numbers.spelled_as_digits(text)))


# A literal of code or notation ("'+'", "**", "->", "~"): no word to count, read as written.
_PUNCTUATION = frozenset(".,;:!?\u2026-()[]")  # sentence marks alone are no literal
_LITERAL = re.compile(r"[^\sA-Za-z0-9\u3400-\u9fff]+")


# An identifier of code as written: an option ("--verify"), a constant or variable
# ("LESS", "ZSTD_CLEVEL"), a call, a dotted or camelCase name ("os.path", "getItem").
_CODE = re.compile(r"[_()]|[a-z][A-Z]|^[A-Z][A-Z0-9_]{2,}$|\w\.\w|^-{1,2}\w")


def looks_like_code(surface: str) -> bool:
    """Whether one token, as written, is an identifier of code rather than a word."""
    return _CODE.search(surface) is not None


def literal_in(answer: str, source: str) -> bool:
    """Whether `answer` is a literal of symbols only ("'+'", "**", "~") that `source` writes
    as it is. Sentence marks alone ("!", ":") are a literal only where `source` quotes them
    ("(`!`)", "':'"): a mark a passage quotes is one of its literals, a mark that
    ends one of its sentences is not."""
    bare = strip_markers(answer).strip().strip(words.QUOTES).strip()
    symbols = bare.replace(" ", "")
    if not symbols or _LITERAL.fullmatch(symbols) is None:
        return False
    if set(symbols) - _PUNCTUATION:
        return bare in source
    quote = f"[{re.escape(words.QUOTES)}]"
    return re.search(f"{quote}{re.escape(bare)}{quote}", source) is not None


def cite(answer: str, evidence: Evidence) -> Cited:
    """Citations of an answer: the markers it wrote that were in the prompt (any other is
    dropped and reported); without a valid marker, the evidence passage that contains the
    answer's words, or the one passage that holds a literal answer as written."""
    citations: list[EvidenceItem] = []
    dropped: list[str] = []
    for number in MARKER.findall(answer):
        marker = f"[{int(number)}]"
        item = evidence.marker_of(marker)
        if item is None:
            dropped.append(marker)
        elif item not in citations:
            citations.append(item)
    if not citations:
        words = _compared_words(strip_markers(answer))
        if words:
            overlap = [
                (len(words & _compared_words(item.text)) / len(words), -n, item)
                for n, item in enumerate(evidence.items)
            ]
            share, _, best = max(overlap, key=lambda row: row[:2])
            if share >= 0.5:
                citations.append(best)
        else:
            # "~" in two passages says nothing about which one it came from.
            holding = [item for item in evidence.items if literal_in(answer, item.text)]
            citations.extend(holding if len(holding) == 1 else ())
    return Cited(citations, dropped)


# A small model at times writes its passage number as "(1)" (a document's own "[n]" reaches
# it so, as_data) instead of "[1]": at the end of its answer, after a space, it is a marker.
_TRAILING_MARKER = re.compile(r"\s\((\d{1,3})\)[\s.]*$")


def with_markers(answer: str, evidence: Evidence) -> str:
    """`answer` with a passage number written "(n)" at its end as the marker "[n]", where the
    answer writes no other marker and the prompt held [n] ("less(1)" is a name, left)."""
    found = _TRAILING_MARKER.search(answer)
    if found is None or MARKER.search(answer):
        return answer
    marker = f"[{int(found.group(1))}]"
    return f"{answer[: found.start()]} {marker}" if evidence.marker_of(marker) else answer


def strip_markers(text: str) -> str:
    return MARKER.sub("", text).strip()


def is_refusal(answer: str) -> bool:
    return "not in the evidence" in answer.lower()
