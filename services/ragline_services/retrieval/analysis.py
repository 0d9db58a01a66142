"""Lexical analysis for BM25: Chinese, English and both mixed in one field.

Text is split into runs by script. A run of Han characters is segmented into words by
jieba (its dictionary ships in the package; nothing is downloaded) in its search mode,
which also emits the shorter words inside a long one ("双缓冲索引" -> 缓冲, 索引, ...),
so a question worded a little differently still meets the passage's words. Every other run
goes through tantivy's `en_stem` analysis as before (split on what is not a letter or
digit, lower-cased, words over 40 bytes dropped, Snowball English stemming), so English
text is indexed exactly as it was. "用双缓冲索引解决HNSW重建" -> 用 双 缓冲 索引 解决 hnsw 重建.

Documents are indexed with these tokens (tantivy's pre-tokenized text: the stored text is
the original); a query is rewritten into the same words separated by spaces, with English
and Chinese stop words dropped, and the field's `en_stem` then reads it as before (a Han
word passes through it unchanged). Text is NFKC-normalised first on both sides, so
full-width letters and digits match their ASCII forms.

`ANALYSIS` names this analysis: a tenant index made by another one is re-indexed in the
background (bm25.py), and answers meanwhile as before.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Collection
from typing import Any

from ragline import lexicon, words
from ragline.stopwords import CHINESE_STOP_WORDS, STOP_WORDS

# 1: tantivy's en_stem over the raw text (a Chinese sentence was one token). 2: this.
ANALYSIS = 2

# CJK Unified Ideographs, Extension A and the Compatibility block: the characters jieba
# segments; kana and Hangul stay with en_stem (one token per run, as before).
_HAN = words.HAN
_NOT_WORD = re.compile(r"[^\w]+", re.UNICODE)
_MAX_TOKEN_BYTES = 40  # en_stem's remove_long
# Translations added to a query: Chinese words up to this long (longer ones are idioms and
# full names the passage would not write alike), and the first glosses of a Chinese word
# (the lexicon lists a word's common senses first).
_MAX_TRANSLATED_CHARS = 4
_GLOSSES_PER_WORD = 3
_TRANSLATIONS_PER_WORD = 3


class Analyzer:
    """Thread-safe once built; building loads jieba's dictionary (about 0.5 s), so a
    service does it off the event loop (`warm`)."""

    def __init__(self) -> None:
        self._jieba = None
        # tantivy's English analyzer, made with the segmenter (tantivy imported lazily).
        self._english: Any = None
        self._lock = threading.Lock()

    def warm(self) -> None:
        self._segmenter()
        lexicon.shared()

    def translations(self, query: str, written: Collection[str] | None = None) -> list[str]:
        """Words of the other language that say what `query`'s words say (the
        Chinese-English lexicon, `ragline.lexicon`; none without it): the commonest three
        Chinese words an English term translates to where the query holds their whole
        gloss, and the English terms of a Chinese word's first glosses. A question in one
        language then also meets passages written in the other. `written`: the query's own
        words (`query_words`), left out; computed when not given."""
        table = lexicon.shared()
        if table is None:
            return []
        text = unicodedata.normalize("NFKC", query)
        english = words.english_terms(text)
        context = frozenset(english)
        found: list[str] = []
        frequency = self._segmenter().FREQ
        for term in dict.fromkeys(english):
            chinese = [
                w for w in table.chinese(term, context) if 1 < len(w) <= _MAX_TRANSLATED_CHARS
            ]
            # The commonest few (jieba's dictionary counts how often each word is written).
            chinese.sort(key=lambda w: (-frequency.get(w, 0), w))
            found += chinese[:_TRANSLATIONS_PER_WORD]
        for word in dict.fromkeys(words.han_words(text)) if words.has_han(text) else ():
            for gloss in table.english(word)[:_GLOSSES_PER_WORD]:
                found += sorted(gloss)
        asked = set(self.query_words(query) if written is None else written)
        return [w for w in dict.fromkeys(found) if w not in asked and w not in STOP_WORDS]

    def _segmenter(self):
        if self._jieba is None:
            with self._lock:
                if self._jieba is None:
                    import tantivy

                    self._english = (
                        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
                        .filter(tantivy.Filter.remove_long(_MAX_TOKEN_BYTES))
                        .filter(tantivy.Filter.lowercase())
                        .filter(tantivy.Filter.stemmer("english"))
                        .build()
                    )
                    self._jieba = words.segmenter()
        return self._jieba

    def document_tokens(self, text: str) -> list[tuple[str, int, int]]:
        """(token, start, end) of `text` as indexed, offsets into the NFKC-normalised text."""
        segmenter = self._segmenter()
        text = unicodedata.normalize("NFKC", text)
        tokens: list[tuple[str, int, int]] = []
        for start, end, han in _runs(text):
            run = text[start:end]
            if han:
                for word, begin, finish in segmenter.tokenize(run, mode="search"):
                    tokens.append((word, start + begin, start + finish))
            else:
                # en_stem's own tokens; offsets of the run (snippets are not made here).
                tokens.extend((word, start, end) for word in self._english.analyze(run))
        return tokens

    def pre_tokenized(self, tantivy, text: str):
        """`text` as tantivy's PreTokenizedString: stored as it is, indexed as analysed."""
        tokens = [
            tantivy.Token(word, position, begin, finish)
            for position, (word, begin, finish) in enumerate(self.document_tokens(text))
        ]
        return tantivy.PreTokenizedString(text, tokens)

    def query_words(self, query: str, stop_words: frozenset[str] = STOP_WORDS) -> list[str]:
        """The words of a query, stop words out (all of them when nothing else is left):
        English words as written (the field's en_stem stems them), Han runs segmented.
        `stop_words`: the English set (tools compare others)."""
        segmenter = self._segmenter()
        text = unicodedata.normalize("NFKC", query).lower()
        found: list[str] = []
        for start, end, han in _runs(text):
            run = text[start:end]
            if han:
                found.extend(segmenter.lcut_for_search(run))
            else:
                found.extend(_NOT_WORD.sub(" ", run).split())
        kept = [w for w in found if w not in stop_words and w not in CHINESE_STOP_WORDS]
        return kept or found


def _runs(text: str):
    """(start, end, is_han) of consecutive runs of Han and of other characters."""
    position = 0
    for match in _HAN.finditer(text):
        if match.start() > position:
            yield position, match.start(), False
        yield match.start(), match.end(), True
        position = match.end()
    if position < len(text):
        yield position, len(text), False
