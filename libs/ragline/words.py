"""Words of Chinese text, for the checks that compare words (evidence overlap, grounding,
answerability) and for BM25's analysis.

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

from ragline.stopwords import CHINESE_STOP_WORDS

# CJK Unified Ideographs, Extension A and the Compatibility block.
HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")

_lock = threading.Lock()
_segmenter = None


def segmenter():
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


def has_han(text: str) -> bool:
    return HAN.search(text) is not None


def han_terms(text: str) -> list[str]:
    """The terms of the Han runs of `text` (see the module's docstring), in order."""
    terms: list[str] = []
    for run in HAN.findall(text):
        for word in segmenter().lcut(run):
            if word in CHINESE_STOP_WORDS:
                continue
            if len(word) == 1:
                terms.append(word)
            else:
                terms.extend(word[i : i + 2] for i in range(len(word) - 1))
    return terms
