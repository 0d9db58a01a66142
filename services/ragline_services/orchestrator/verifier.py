"""Does the answer answer the question asked? The grounding check (grounding.py) proves that
an answer's words are in the passage it cites; this module judges whether they are the
words the question asks for, and not another item of the same passage ("the line
attribute" for a question about the column, the wrong one of four listed constants, the
date of another event in the same sentence).

It reads where the answer stands in its cited text, as a reader would:
- `local`: how much of the question (its content terms, weighted by rarity in the evidence)
  stands close to the answer, in the answer's own sentence (the qualifiers "column", "on
  32-bit platforms", "without arguments" are next to the right item, not to its
  neighbours);
- `margin`: that closeness against the best competing candidate of the same kind in the
  evidence (other numbers for a number, other names for a name, other identifiers for an
  identifier): an answer beaten by a candidate that sits among the question's words is
  probably that candidate's neighbour;
- `sentence` and `sentence_gap`: how much of the question the answer's sentence holds, and
  how far it is behind the evidence sentence holding the most;
- `type_mismatch`: the question asks for a number, a date, a person or a yes/no and the
  answer is not one;
- `echo`: the share of the answer's words that only repeat the question;
- `unplaced`: the answer's words could not be found together in the cited text.

Beside them, where the engine reports its tokens' probabilities, the model's own
confidence (confidence.py: the mean log-probability of the answer's tokens): a model
choosing between two items of a list is less sure of either than one copying the only
candidate, and a model writing an answer the evidence does not hold is unsure of it.

A logistic model (`FIT`, or `FIT_WITH_CONFIDENCE` where the confidence is known; fitted by
`tools/fit_verifier.py` on drafts of the stack's own models; figures in
docs/answer-states.md) turns them into an estimate that the answer is right; below the
server's threshold the answer is INCOMPLETE `unverified`, its draft kept. Pure functions;
no model call.

Why one file of this length: every feature reads the same positioned tokens (`_tokens`,
`_locate`), and `FIT`'s weights name the features in `Features`' order.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import astuple, dataclass, replace

from ragline import numbers, units
from ragline.words import FUNCTION_WORDS, HAN, has_han, segmenter, stem
from ragline_services.orchestrator import answerability
from ragline_services.orchestrator import evidence as ev

# Bump when what the verifier decides changes: the answer cache keys on it.
# v3: the large tier cross-checks unsure answers; v4: the support check reads choices,
# restated question words, names in capitals and the cited passage whole (grounding.py);
# v5: irregular plurals, a wrong marker moved, cross-lingual answers cross-checked; v6: an
# adjective of place names its place in the off-subject check, the kind asked is not an
# echo, an answer is placed in its passage however the passage writes it; v7: an answer's
# restatement of the question is cut before it is checked (restatement.py); v8: a number's
# unit is read by its name ("3s" is "3 seconds") in the support check, placement and
# agreement (ragline.units), and answers naming different numbers never agree; v9: a
# sentence mark its passage quotes is a literal answer ("!"), and a part of a joined
# question is judged against its clause as asked, not the subject its lookup carried.
VERSION = "verifier-v9"
# How fast a question term's weight falls with its distance (in tokens) from the answer.
_DECAY_TOKENS = 4.0
# The same, read far: a qualifier a clause away still counts a little.
_FAR_DECAY_TOKENS = 12.0
_PREFIX = 6
# Clause and list-item boundaries: a qualifier across one is further than it looks.
_CLAUSE = frozenset(",;:()，、；：（）") | frozenset({"and", "or", "but", "while", "whereas"})
_CLAUSE_TOKENS = 3.0
# Question words: asked with, never matched.
_QUESTION_WORDS = frozenset(
    "what when where which who whom whose why how name kind type year many much did does do "
    "is are was were can could should would".split()
)
# A word, a number or an identifier of code ("--sort=inode", "os.path", "__init__()"), a
# run of Chinese (segmented later), or one mark.
_TOKEN = re.compile(
    r"(?:(?<![\w-])-{1,2}(?=[A-Za-z]))?[A-Za-z0-9_]+(?:[.:'=\-][A-Za-z0-9_]+)*(?:\(\))?"
    r"|[\u3400-\u4dbf\u4e00-\u9fff]+|[^\s\w]"
)
_SENTENCE_END = frozenset(".!?。！？；;")
_MONTHS = frozenset(
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
_YEAR = re.compile(r"^(1[0-9]{3}|20[0-9]{2})s?$")


class AnswerType(enum.StrEnum):
    NUMBER = "number"
    DATE = "date"
    PERSON = "person"
    YES_NO = "yes_no"
    ANY = "any"


# What a question asks for, by its question words: the first rule that matches decides.
_CHINESE_TYPES = (
    (re.compile(r"哪一?年|什么时候|何时|哪天|几月|哪个月"), AnswerType.DATE),
    (re.compile(r"多少|几[个位种次岁年天]?|多[长大高远久重]"), AnswerType.NUMBER),
    (re.compile(r"谁"), AnswerType.PERSON),
)
_ENGLISH_TYPES = (
    (
        re.compile(r"^(when|what (year|date|day|month|century|decade)|in (what|which) year)\b"),
        AnswerType.DATE,
    ),
    (
        re.compile(
            r"\bhow (many|much|long|far|old|large|big|high|tall|often)\b"
            r"|\bwhat (percentage|percent|number|amount|fraction|proportion)\b"
        ),
        AnswerType.NUMBER,
    ),
    (re.compile(r"^(who|whom|whose)\b"), AnswerType.PERSON),
    (
        re.compile(r"^(is|are|was|were|does|do|did|can|could|will|should|has|have)\b"),
        AnswerType.YES_NO,
    ),
)


def expected_type(question: str) -> AnswerType:
    """What kind of answer the question asks for, from its question words."""
    chinese = has_han(question)
    text = question if chinese else question.lower().strip()
    rules = _CHINESE_TYPES if chinese else _ENGLISH_TYPES
    return next((kind for pattern, kind in rules if pattern.search(text)), AnswerType.ANY)


def _is_number(token: str) -> bool:
    return bool(numbers.numbers(token)) or numbers.ordinal_value(token) is not None


def _is_date_part(token: str) -> bool:
    return bool(_YEAR.match(token)) or token.lower() in _MONTHS


def type_mismatch(expected: AnswerType, answer: str) -> bool:
    """Whether the answer plainly is not what the question asks for."""
    tokens = _TOKEN.findall(answer)
    if expected == AnswerType.NUMBER:
        return not numbers.numbers(answer) and not any(_is_number(t) for t in tokens)
    if expected == AnswerType.DATE:
        return not numbers.numbers(answer) and not any(_is_date_part(t) for t in tokens)
    if expected == AnswerType.PERSON:
        if has_han(answer):
            return False
        return not any(t[:1].isupper() for t in tokens) or all(_is_number(t) for t in tokens)
    if expected == AnswerType.YES_NO:
        return False  # "yes", "no", or the thing asked about: either answers it
    return False


# -- reading a text as positioned terms -----------------------------------------------------


@dataclass(frozen=True)
class _Token:
    surface: str
    term: str  # normalised: stemmed, numbers canonical; "" for punctuation
    sentence: int
    start: int = 0  # where the token stands in its text (characters)
    end: int = 0
    # The terms of a setting's sides ("METHOD=replace", "1=ZSTD_fast"): an answer may be
    # either side alone.
    sides: tuple[str, ...] = ()


def _tokens(text: str) -> list[_Token]:
    out: list[_Token] = []
    sentence = 0
    # A number in words over several words is one token: "three hundred sixty" is 360.
    runs = {start: (end, value) for start, end, value in numbers.word_runs(text)}
    inside = 0  # where the run being read ends
    for match in _TOKEN.finditer(text):
        raw, at = match.group(0), match.start()
        if at < inside:
            continue
        if at in runs:
            inside, number = runs[at]
            out.append(_Token(text[at:inside], number, sentence, at, inside))
            continue
        if HAN.fullmatch(raw):
            for word in segmenter().lcut(raw):
                out.append(_Token(word, word, sentence, at, at + len(word)))
                at += len(word)
                if word in _SENTENCE_END:
                    sentence += 1
            continue
        if raw in _SENTENCE_END:
            out.append(_Token(raw, "", sentence, at, match.end()))
            sentence += 1
            continue
        # A unit right after a number is read by its name: "64 KB" says "64 kilobytes",
        # "60%" says "60 percent" (the number is looked at only for a unit's form).
        unit = units.name_of(raw)
        if unit is not None and not _after_number(out, sentence):
            unit = None
        head = raw.lstrip("-")[:1]
        if not (head.isalnum() or head == "_"):
            out.append(_Token(raw, _term(unit) if unit else "", sentence, at, match.end()))
            continue
        split = units.glued(raw)
        if split is not None:  # "64KB": the number, then its unit by name
            cut, name = split
            number = raw[:cut]
            value = numbers.numbers(number)
            term = next(iter(value)) if len(value) == 1 else number
            out.append(_Token(number, term, sentence, at, at + cut))
            out.append(_Token(raw[cut:], _term(name), sentence, at + cut, match.end()))
            continue
        if unit is not None:
            term = _term(unit)
        else:
            value = numbers.numbers(raw)
            term = next(iter(value)) if len(value) == 1 else _term(raw)  # "two" is 2
        sides = tuple(_term(side) for side in raw.split("=") if side) if "=" in raw else ()
        out.append(_Token(raw, term, sentence, at, match.end(), sides))
    return out


def _after_number(tokens: list[_Token], sentence: int) -> bool:
    """Whether the last token read is a number of the same sentence (a unit may follow):
    digits or number words ("64", "two"), not a name holding digits ("x86", "F-16")."""
    if not tokens or tokens[-1].sentence != sentence:
        return False
    surface = tokens[-1].surface
    written = surface[:1].isdigit() or surface.replace(" ", "").replace("-", "").isalpha()
    return written and bool(numbers.numbers(surface))


def _answer_tokens(text: str) -> list[_Token]:
    """The answer's terms; an answer of marks alone ("$", "~": a character asked for) is
    its marks, found in a text as they are written."""
    tokens = _tokens(text)
    words = [t for t in tokens if t.term]
    if words or not text.strip():
        return words
    return [replace(t, term=t.surface) for t in tokens]


def _held(token: _Token, wanted: set[str]) -> set[str]:
    """The wanted terms `token` holds: its term, a side of a setting, or a mark as written."""
    return wanted & {token.term or token.surface, *token.sides}


def _term(word: str) -> str:
    """A word as the verifier matches it: stemmed, then cut to its first
    `_PREFIX` letters, so that "genocidal" meets "genocide" and "particularly" meets
    "particular" (a question paraphrases its passage; identifiers are kept whole)."""
    stemmed = stem(word)
    if len(stemmed) > _PREFIX and stemmed.isalpha():
        return stemmed[:_PREFIX]
    return stemmed


def _content(token: _Token) -> bool:
    return bool(token.term) and token.term not in FUNCTION_WORDS


@dataclass(frozen=True)
class _Asked:
    """One content term of the question, with the forms that say it in the cited text's
    language (the Chinese-English lexicon's translations) and its weight."""

    forms: frozenset[str]
    weight: float


def _question_terms(question: str, evidence_tokens: list[list[_Token]]) -> list[_Asked]:
    translated = {t.term: t for t in answerability.translated_terms(question)}
    seen: dict[str, set[str]] = {}
    for token in _tokens(question):
        if not _content(token) or token.term in _QUESTION_WORDS:
            continue
        forms = seen.setdefault(token.term, {token.term})
        found = translated.get(token.term)
        if found is not None:
            forms |= set(found.chinese)
            forms |= {stem(next(iter(g))) for g in found.english if len(g) == 1}
        if has_han(token.term):
            # jieba may cut the passage otherwise; its bigrams and their translations too.
            for term in answerability.translated_terms(token.term):
                forms.add(term.term)
                forms |= {stem(next(iter(g))) for g in term.english if len(g) == 1}
    sentences = [
        {t.term for t in tokens if t.sentence == s}
        for tokens in evidence_tokens
        for s in {t.sentence for t in tokens}
    ]
    asked = []
    for forms in seen.values():
        frequency = sum(1 for sentence in sentences if forms & sentence)
        weight = math.log(1 + (len(sentences) + 1) / (1 + frequency))
        asked.append(_Asked(frozenset(forms), weight))
    return asked


def _locate(answer: list[_Token], tokens: list[_Token]) -> tuple[int, int] | None:
    """The span [start, end) of `tokens` holding the most of the answer's terms, as short
    as that allows; None when none of them is there."""
    wanted = [t.term for t in answer if t.term]
    if not wanted:
        return None
    wanted_set = set(wanted)
    best: tuple[int, int, int] | None = None  # (matches, -length, start)
    width = len(wanted) + 2
    for start in range(len(tokens)):
        if not _held(tokens[start], wanted_set):
            continue
        seen: set[str] = set()
        for end in range(start, min(len(tokens), start + width)):
            if held := _held(tokens[end], wanted_set):
                seen |= held
                key = (len(seen), -(end - start + 1), -start)
                if best is None or key > best:
                    best = key
    if best is None:
        return None
    matches, negative_length, negative_start = best
    if matches < max(1, math.ceil(0.5 * len(wanted_set))):
        return None
    return -negative_start, -negative_start - negative_length


def _distance(tokens: list[_Token], i: int, start: int, end: int) -> float:
    """Tokens between position `i` and the span, each clause boundary crossed counting as
    `_CLAUSE_TOKENS` more: a qualifier belongs to its own clause or list item."""
    low, high = (i + 1, start) if i < start else (end, i)
    between = tokens[low:high]
    return len(between) + 1 + _CLAUSE_TOKENS * sum(t.surface in _CLAUSE for t in between)


def _closeness(
    asked: Sequence[_Asked],
    tokens: list[_Token],
    span: tuple[int, int],
    skip: set[str],
    decay: float = _DECAY_TOKENS,
) -> float:
    """The weighted share of the question's terms near `span`, in its sentence (terms the
    candidate itself holds, `skip`, are neither counted nor expected)."""
    start, end = span
    sentence = tokens[start].sentence
    total = got = 0.0
    for item in asked:
        if item.forms & skip:
            continue
        total += item.weight
        distances = [
            _distance(tokens, i, start, end)
            for i, token in enumerate(tokens)
            if token.sentence == sentence and not start <= i < end and token.term in item.forms
        ]
        if distances:
            got += item.weight * math.exp(-(min(distances) - 1) / decay)
    return got / total if total else 0.0


def _sentence_share(asked: Sequence[_Asked], tokens: list[_Token], sentence: int) -> float:
    held = {t.term for t in tokens if t.sentence == sentence}
    total = sum(a.weight for a in asked)
    return sum(a.weight for a in asked if a.forms & held) / total if total else 0.0


def _clause_share(asked: Sequence[_Asked], tokens: list[_Token], span: tuple[int, int]) -> float:
    """The weighted share of the question's terms in the clause holding `span` (from the
    clause boundary before it to the one after it, inside its sentence)."""
    sentence = tokens[span[0]].sentence
    start, end = span
    while start > 0 and tokens[start - 1].sentence == sentence and not _boundary(tokens[start - 1]):
        start -= 1
    while end < len(tokens) and tokens[end].sentence == sentence and not _boundary(tokens[end]):
        end += 1
    held = {t.term for t in tokens[start:end]} - {t.term for t in tokens[span[0] : span[1]]}
    total = sum(a.weight for a in asked)
    return sum(a.weight for a in asked if a.forms & held) / total if total else 0.0


def _boundary(token: _Token) -> bool:
    return token.surface in _CLAUSE or token.surface in _SENTENCE_END


def _candidates(tokens: list[_Token], kind: str) -> list[tuple[int, int]]:
    """Spans of `tokens` of one kind: runs of numbers/dates, of capitalised words, or
    identifiers of code."""
    spans, start = [], None
    for i, token in enumerate([*tokens, _Token("", "", -1)]):
        if kind == "number":
            # Counts and dates; an ordinal ("first") names a position, not a rival count.
            fits = bool(token.term) and (
                bool(numbers.numbers(token.surface)) or _is_date_part(token.surface)
            )
        elif kind == "name":
            fits = token.surface[:1].isupper() and token.term not in FUNCTION_WORDS
        else:
            fits = bool(token.term) and ev.looks_like_code(token.surface)
        if fits and start is None:
            start = i
        elif not fits and start is not None:
            opens_sentence = start == 0 or tokens[start - 1].sentence != tokens[start].sentence
            if not (kind == "name" and i - start == 1 and opens_sentence):
                # One capitalised word opening a sentence is as often no name ("Soon").
                spans.append((start, i))
            start = None
    return spans


def _parallel(tokens: list[_Token], span: tuple[int, int]) -> list[tuple[int, int]]:
    """Spans standing in the answer's slot elsewhere in its text: before or after the same
    word as the answer ("lineno attribute" beside "col_offset attribute"), or the other
    items of a list the answer is one item of ("A, B, C and D")."""
    start, end = span
    width = end - start
    left = tokens[start - 1].term if start > 0 else ""
    right = tokens[end].term if end < len(tokens) else ""
    out = []
    for i, token in enumerate(tokens):
        if start - width <= i < end:
            continue
        if right and _content(tokens[end]) and token.term == right and i - width >= 0:
            out.append((i - width, i))
        if (
            left
            and _content(tokens[start - 1])
            and token.term == left
            and i + 1 + width <= len(tokens)
        ):
            out.append((i + 1, i + 1 + width))
    # A list: items joined by commas and a last "and"/"or", in the answer's sentence.
    joins = {",", "、", "，", "and", "or", "和", "或"}
    before = tokens[start - 1].surface if start > 0 else ""
    after = tokens[end].surface if end < len(tokens) else ""
    if before in joins or after in joins:
        sentence = tokens[start].sentence
        item: list[int] = []
        for i, token in enumerate([*tokens, _Token(".", "", -1)]):
            if token.sentence == sentence and token.surface not in joins and token.term:
                item.append(i)
                continue
            if item and (item[0] >= end or item[-1] < start) and len(item) <= width + 3:
                out.append((item[0], item[-1] + 1))
            item = []
    return [s for s in out if 0 <= s[0] < s[1] <= len(tokens)]


def _kind_of(answer: list[_Token], expected: AnswerType) -> str | None:
    surfaces = [t.surface for t in answer if t.term]
    if not surfaces:
        return None
    if expected in (AnswerType.NUMBER, AnswerType.DATE) or all(
        _is_number(s) or _is_date_part(s) for s in surfaces
    ):
        return "number"
    if any(ev.looks_like_code(s) for s in surfaces):
        return "code"
    if all(s[:1].isupper() or s.lower() in FUNCTION_WORDS for s in surfaces):
        return "name"
    return None


@dataclass(frozen=True)
class Features:
    local: float
    local_far: float
    margin: float
    # The best rival's share of the closeness of it and the answer (0.5: a tie; over
    # 0.5: a rival sits closer to the question's words than the answer; 0: no rival).
    beaten: float
    # How much more of the question the best rival's own clause holds than the answer's.
    clause_gap: float
    competitors: float  # 1.0 when a competing candidate of the answer's kind exists
    sentence: float
    sentence_gap: float
    type_mismatch: float
    echo: float
    unplaced: float
    length: float  # log(1 + the answer's words)
    answerability: float  # the gate's estimate that the evidence answers the question

    def vector(self) -> list[float]:
        return list(astuple(self))


FEATURE_NAMES = tuple(Features.__dataclass_fields__)


def features(
    question: str,
    answer: str,
    cited: Sequence[ev.EvidenceItem],
    evidence: Sequence[ev.EvidenceItem],
    answerability: float | None = None,
) -> Features:
    """What the verifier reads of `answer` (markers allowed) to `question`, cited from
    `cited` among `evidence`; `answerability`: the gate's estimate for that evidence (None:
    not computed, read as undecided)."""
    return _read(question, answer, cited, evidence, answerability)[0]


# "What type of Turing machine ...?": the thing whose kind is asked.
_KIND_OF = re.compile(
    r"\b(?:type|kind|sort|form|class|style)s? of (?:an? |the )?"
    r"([A-Za-z][\w-]*(?: [A-Za-z][\w-]*)?)",
    re.IGNORECASE,
)


def _kind_asked(question: str) -> frozenset[str]:
    """The terms of what a "what kind of X" question asks the kind of (X's first two words)."""
    found = _KIND_OF.search(question)
    if found is None:
        return frozenset()
    return frozenset(t.term for t in _tokens(found.group(1)) if _content(t))


def _echo(content: list[_Token], question_terms: set[str], kind_of: frozenset[str]) -> float:
    """The share of the answer's content words that only repeat the question. An answer to
    "what kind of X" names its kind beside X ("Non-deterministic Turing machine", "Georgian
    style houses"): X is the answer's head there, not an echo, unless nothing else is said."""
    said = [t for t in content if t.term not in kind_of] or content
    return sum(t.term in question_terms for t in said) / len(said) if said else 0.0


def _read(
    question: str,
    answer: str,
    cited: Sequence[ev.EvidenceItem],
    evidence: Sequence[ev.EvidenceItem],
    answerability: float | None,
) -> tuple[Features, list[tuple[str, float]]]:
    """The features, and the rival candidates of the answer's kind with their closeness to
    the question's words (best first)."""
    gate = 0.5 if answerability is None else answerability
    text = ev.strip_markers(answer)
    answer_tokens = _answer_tokens(text)
    items = list(evidence) or list(cited)
    item_tokens = [_tokens(f"{item.text}") for item in items]
    asked = _question_terms(question, item_tokens)
    expected = expected_type(question)
    question_terms = {form for a in asked for form in a.forms}
    content = [t for t in answer_tokens if _content(t)]
    echo = _echo(content, question_terms, _kind_asked(question))
    mismatch = float(type_mismatch(expected, text))
    length = math.log1p(len(content))
    best_sentence = max(
        (
            _sentence_share(asked, tokens, s)
            for tokens in item_tokens
            for s in {t.sentence for t in tokens}
        ),
        default=0.0,
    )
    placed = _placement(answer_tokens, cited, items, item_tokens)
    if placed is None:
        unplaced = Features(
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -best_sentence, mismatch, echo, 1.0, length, gate
        )
        return unplaced, []
    index, span = placed
    tokens = item_tokens[index]
    own = {t.term for t in tokens[span[0] : span[1]] if t.term}
    local = _closeness(asked, tokens, span, own)
    local_far = _closeness(asked, tokens, span, own, _FAR_DECAY_TOKENS)
    sentence = _sentence_share(asked, tokens, tokens[span[0]].sentence)
    kind = _kind_of(answer_tokens, expected)
    rivals, rival_clauses, named = _rivals(
        asked, question_terms, items, item_tokens, (index, span), own, kind
    )
    clause = _clause_share(asked, tokens, span)
    clause_gap = max(rival_clauses) - clause if rival_clauses else 0.0
    margin = local - max(rivals) if rivals else 0.0
    best_rival = max(rivals, default=0.0)
    beaten = best_rival / (local + best_rival) if local + best_rival > 0 else 0.0
    found = Features(
        local,
        local_far,
        margin,
        beaten,
        clause_gap,
        float(bool(rivals)),
        sentence,
        sentence - best_sentence,
        mismatch,
        echo,
        0.0,
        length,
        gate,
    )
    # The rivals that sit closer to the question's words than the answer does: those a
    # second read weighs it against.
    best: dict[str, float] = {}
    for closeness, surface in named:
        if surface and surface.lower() != text.strip().lower() and closeness > local:
            best[surface] = max(best.get(surface, 0.0), closeness)
    return found, sorted(best.items(), key=lambda x: -x[1])


def _placement(
    answer_tokens: list[_Token],
    cited: Sequence[ev.EvidenceItem],
    items: list[ev.EvidenceItem],
    item_tokens: list[list[_Token]],
) -> tuple[int, tuple[int, int]] | None:
    """The answer where it stands in its citations (else anywhere in the evidence): the
    item's index and the answer's token span in it."""
    for item in [*cited, *items]:
        if item not in items:
            continue
        at = items.index(item)
        span = _locate(answer_tokens, item_tokens[at])
        if span is not None:
            return at, span
    return None


def _rivals(
    asked: list[_Asked],
    question_terms: set[str],
    items: list[ev.EvidenceItem],
    item_tokens: list[list[_Token]],
    placed: tuple[int, tuple[int, int]],
    own: set[str],
    kind: str | None,
) -> tuple[list[float], list[float], list[tuple[float, str]]]:
    """The candidates that compete with the answer placed at `placed`: those of its kind
    anywhere in the evidence, and the parallel items of its own list. Their closeness to
    the question's words, the share of the question their clauses hold, and (closeness,
    surface) each."""
    index, span = placed
    tokens = item_tokens[index]
    rivals: list[float] = []
    rival_clauses: list[float] = []
    named: list[tuple[float, str]] = []

    def add(item: int, other: list[_Token], candidate: tuple[int, int]) -> None:
        terms = {t.term for t in other[candidate[0] : candidate[1]] if t.term}
        if not terms or terms & question_terms or terms <= own:
            return  # the question's own subject is not a rival answer
        rivals.append(_closeness(asked, other, candidate, terms))
        rival_clauses.append(_clause_share(asked, other, candidate))
        named.append((rivals[-1], _surface(items[item].text, other, candidate)))

    if kind is not None:
        for other_index, other in enumerate(item_tokens):
            for candidate in _candidates(other, kind):
                if other_index == index and candidate[0] < span[1] and span[0] < candidate[1]:
                    continue  # the answer itself
                add(other_index, other, candidate)
    for candidate in _parallel(tokens, span):
        add(index, tokens, candidate)
    return rivals, rival_clauses, named


def _surface(text: str, tokens: list[_Token], span: tuple[int, int]) -> str:
    return text[tokens[span[0]].start : tokens[span[1] - 1].end].strip()


# The model's confidence is read no lower than this (a mean token probability of e^-5):
# below it one token's near-zero probability would outweigh every other reading.
CONFIDENCE_FLOOR = -5.0


def confidence_read(answer_logprob: float) -> float:
    return max(answer_logprob, CONFIDENCE_FLOOR)


@dataclass(frozen=True)
class Fit:
    """The logistic model: weights in FEATURE_NAMES order, the weight of the model's own
    confidence (0 in a fit made without it), and the bias."""

    weights: tuple[float, ...]
    bias: float
    confidence: float = 0.0

    def estimate(self, found: Features, answer_logprob: float | None = None) -> float:
        z = self.bias + sum(w * x for w, x in zip(self.weights, found.vector(), strict=True))
        if answer_logprob is not None:
            z += self.confidence * confidence_read(answer_logprob)
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))


# Fitted by tools/fit_verifier.py (docs/answer-states.md has the data, the command and the
# calibration curve). FIT reads the words alone: an engine that reports no token
# probabilities (the Triton path), or a cached draft that has none.
FIT = Fit(
    weights=(0.623, 1.574, 0.313, -0.391, -0.083, 0.478, 1.133, 0.641, -0.594, -0.707, -0.686,
             -0.723, 1.216),
    bias=-0.67,
)  # fmt: skip


# The words and the model's confidence together, where the engine reports it for a model
# of the family it was fitted on: one model's log-probabilities are not another's (a
# smaller model is less sure of everything), so any other model's answer is read by its
# words alone, as the gate reads an embedding model it has no fit for.
FIT_WITH_CONFIDENCE = Fit(
    weights=(0.619, 1.455, 0.296, -0.27, -0.045, 0.345, 0.953, 0.666, -0.556, -0.721, -0.485,
             -0.839, 1.159),
    bias=0.163,
    confidence=1.636,
)  # fmt: skip
CONFIDENCE_FAMILIES = frozenset({"qwen2.5-coder"})  # both tiers' answers were fitted on


def estimate(
    found: Features,
    answer_logprob: float | None,
    words: Fit = FIT,
    with_confidence: Fit = FIT_WITH_CONFIDENCE,
) -> float:
    """The estimate from the words alone where the confidence is unknown, else from both
    (tools/fit_verifier.py passes the fits it is making)."""
    if answer_logprob is None:
        return words.estimate(found)
    return with_confidence.estimate(found, answer_logprob)


def confidence_fitted(model: str) -> bool:
    """Whether `model` ("qwen2.5-coder-1.5b") is of a family the confidence was fitted on."""
    return any(model == f or model.startswith(f + "-") for f in CONFIDENCE_FAMILIES)


@dataclass(frozen=True)
class Verification:
    estimate: float
    features: Features
    answer_logprob: float | None = None
    # Candidates of the answer's kind in the evidence that sit closer to the question's
    # words than the answer, the closest first: what a second read weighs it against.
    rivals: tuple[str, ...] = ()

    def explain(self) -> str:
        f = self.features
        told = []
        if f.type_mismatch:
            told.append("the answer is not the kind the question asks for")
        if f.unplaced:
            told.append("its words are not together in its citation")
        if f.margin < 0:
            told.append("another candidate in the evidence sits closer to the question's words")
        if f.sentence_gap < -0.25:
            told.append("its sentence holds less of the question than another")
        if f.echo > 0.5:
            told.append("it mostly repeats the question")
        if self.answer_logprob is not None and self.answer_logprob < _UNSURE_LOGPROB:
            told.append(f"the model was unsure of it ({math.exp(self.answer_logprob):.2f})")
        reasons = "; ".join(told) or "the question's words are not near it"
        return f"estimate {self.estimate:.2f} that it answers the question ({reasons})"


# A mean token probability below one half: the model was torn between readings.
_UNSURE_LOGPROB = math.log(0.5)


def verify(
    question: str,
    answer: str,
    cited: Sequence[ev.EvidenceItem],
    evidence: Sequence[ev.EvidenceItem],
    answerability: float | None = None,
    answer_logprob: float | None = None,
    model: str = "",
) -> Verification:
    """The estimate that `answer` answers `question`; `answer_logprob`: the confidence
    (confidence.py) of `model`, which wrote it; None where the engine did not report it."""
    found, rivals = _read(question, answer, cited, evidence, answerability)
    if not confidence_fitted(model):
        answer_logprob = None  # on a scale no fit knows: the words alone
    return Verification(
        estimate(found, answer_logprob),
        found,
        answer_logprob,
        tuple(name for name, _ in rivals),
    )
