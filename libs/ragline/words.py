"""Words of English and Chinese text, for the checks that compare words (evidence overlap,
grounding, answerability) and for BM25's analysis.

Chinese has no spaces between words. `segmenter()` is jieba's (its dictionary ships in the
package; nothing is downloaded), loaded once per process. `han_terms` turns a run of Han
characters into terms a comparison can rely on: jieba's words without function and question
words, each as its character bigrams (a one-character word as itself). Bigrams make two
segmentations of the same characters agree: "约6300公里" in an answer and "全长约6300公里"
in a passage share 约 and 公里 whatever jieba cut around them.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from ragline.stopwords import CHINESE_STOP_WORDS

# CJK Unified Ideographs, Extension A and the Compatibility block.
HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")

_lock = threading.Lock()
_segmenter = None


def segmenter() -> Any:  # a jieba.Tokenizer (jieba has no type information)
    """jieba's tokenizer, initialised on first use (about half a second: call it off the
    event loop, or at start)."""
    global _segmenter
    if _segmenter is None:
        with _lock:
            if _segmenter is None:
                import jieba

                jieba.setLogLevel(logging.WARNING)
                tokenizer = jieba.Tokenizer()
                # It caches its parsed dictionary in the temp directory when it can.
                tokenizer.initialize()
                _segmenter = tokenizer
    return _segmenter


# Function words carry no evidence of an answer (they match nearly every sentence).
FUNCTION_WORDS = frozenset(
    """a an and are as at be been but by can could did do does for from had has have how in
    into is it its of on or that the their there these they this those to was were what when
    where which while who whom whose why will with would not no so than then also about after
    before during many much most more other some such only each""".split()
)
# Quotation marks and backticks around a quoted literal ("'+'", `**`), straight and curly.
QUOTES = "`\"'\u201c\u201d\u2018\u2019"
LATIN_WORD = re.compile(r"[A-Za-z0-9]+(?:'[a-z]+)?")


def english_words(text: str) -> list[str]:
    """The words of `text` in Latin letters or digits, lower-cased, function words out."""
    return [w for w in (m.lower() for m in LATIN_WORD.findall(text)) if w not in FUNCTION_WORDS]


def stem(word: str) -> str:
    """A light English normalisation, enough to match "rivers" with "river" and "Poland's"
    with "Poland" (full stemming would join words the question keeps apart), and British
    with American spelling ("metres" with "meters", "colour" with "color": a model writes
    either, whatever its passage wrote)."""
    word = word.lower().removesuffix("'s")
    for suffix, keep in (("ies", "y"), ("sses", "ss"), ("es", "e"), ("s", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            word = word[: -len(suffix)] + keep
            break
    if len(word) >= 5 and word.endswith(("tre", "bre")):
        return word[:-2] + "er"
    if len(word) >= 6 and word.endswith("our"):
        return word[:-2] + "r"
    return word


# English plurals no suffix rule reaches. Not in `stem`: the retrieval index's terms are
# made by it, and an index built before would stop matching its own words.
_IRREGULAR_PLURALS = {
    "feet": "foot",
    "teeth": "tooth",
    "geese": "goose",
    "men": "man",
    "women": "woman",
    "children": "child",
    "mice": "mouse",
    "oxen": "ox",
}


def singular(term: str) -> str:
    """`term` (as `stem` leaves it) in the singular where it is an irregular plural
    ("feet" is "foot": a passage's "25-foot wall" is an answer's "25 feet")."""
    return _IRREGULAR_PLURALS.get(term, term)


# Adjectives of place and their places: "Mongolian" / "Mongolia" / "Mongol", "Victorian" /
# "Victoria", "Canadian" / "Canada", "Indian" / "India". A root under four letters is left
# whole: short names would join too much ("Dan", "Dana").
_PLACE_ENDINGS = ("ian", "ia", "an", "a")


def place_root(term: str) -> str:
    """`term` (as `stem` leaves it) without the ending an adjective of place and its place
    differ by, or `term` where what is left is shorter than four letters."""
    for ending in _PLACE_ENDINGS:
        if term.endswith(ending) and len(term) - len(ending) >= 4:
            return term[: -len(ending)]
    return term


def english_terms(text: str) -> list[str]:
    """The content terms of the English (Latin-letter) words of `text`, stemmed."""
    return [stem(w) for w in english_words(text)]


_LATIN_LETTER = re.compile(r"[A-Za-z]")


def mostly_han(text: str) -> bool:
    """Whether `text` is written mostly in Chinese: a Chinese sentence with English terms
    ("高频 query 的 KV Cache 存放在 Redis 中") is; an English one naming something in
    characters ("Kublai Khan (忽必烈) founded ...") is not. A Chinese word is ~1.5
    characters, an English one ~5 letters: the words of each are compared."""
    han = sum(len(run) for run in HAN.findall(text))
    return han > 0 and han * 10 >= len(_LATIN_LETTER.findall(text)) * 3


def has_han(text: str) -> bool:
    return HAN.search(text) is not None


def han_words(text: str) -> list[str]:
    """jieba's words of the Han runs of `text`, function and question words out, in order."""
    return [
        word
        for run in HAN.findall(text)
        for word in segmenter().lcut(run)
        if word not in CHINESE_STOP_WORDS
    ]


def bigrams(word: str) -> list[str]:
    """A Chinese word's terms: its character bigrams (a one-character word as itself)."""
    return [word] if len(word) == 1 else [word[i : i + 2] for i in range(len(word) - 1)]


def han_terms(text: str) -> list[str]:
    """The terms of the Han runs of `text` (see the module's docstring), in order."""
    return [term for word in han_words(text) for term in bigrams(word)]
