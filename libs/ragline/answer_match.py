"""Whether two answers say the same thing: SQuAD's token F1 over a normalisation that
reads numbers as numbers and keeps identifiers whole, or character F1 for Chinese. One
rule for every reader: the bench's scoring against gold answers, and the answer step's
agreement of two models' answers (answer_step.py, the cross-check)."""

from __future__ import annotations

import collections
import re
import string

from ragline import numbers, units
from ragline.words import QUOTES, has_han, singular

# What SQuAD's official normalisation joins but technical answers write as separators: all
# punctuation but that inside an identifier or a number ("--keep-old-files",
# "os.path.basename", "ZSTD_CLEVEL", "3.5"). The official rule made `--sort=inode` one word
# "sortinode" that the answer "inode" shares nothing with, and "rsh(1)" one that "rsh" does
# not match.
_SEPARATORS = frozenset(string.punctuation) - frozenset("-._")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_ABBREVIATION = re.compile(r"\b(?:[a-z]\.){2,}")  # "u.s." is "us"
# A number and its unit in the adjective form ("512-byte", "32-bit") are two words.
_NUMBER_UNIT = re.compile(r"(?<=\d)-(?=[a-z])")


def normalise(text: str) -> str:
    """SQuAD's official normalisation, with numbers written as digits first ("two" and "2"
    are one answer: `ragline.numbers`) and a number's unit by its name ("3s" and "3
    seconds" are one answer: `ragline.units`), punctuation separating words where it is not
    part of an identifier or a number (`_SEPARATORS`), and irregular plurals singular."""
    text = units.spelled_out(numbers.spelled_as_digits(text)).lower()
    text = _THOUSANDS.sub("", text)
    text = _ABBREVIATION.sub(lambda m: m.group(0).replace(".", ""), text)
    text = _NUMBER_UNIT.sub(" ", text)
    text = "".join(" " if c in _SEPARATORS else c for c in text)
    words = (w.strip("-._") for w in text.split())
    text = " ".join(w for w in words if w)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    # "25 feet" against "25-foot": a unit's plural is the unit.
    return " ".join(singular(w) for w in text.split())


def token_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalise(prediction).split(), normalise(gold).split()
    predicted, expected = _compounds_as(expected, predicted), _compounds_as(predicted, expected)
    if not predicted or not expected:
        # A literal of code or notation ("'+'", "**") has no word left once punctuation
        # is out: compared as written, quotes and spaces aside.
        return float(_literal(prediction) == _literal(gold) != "")
    return _bag_f1(predicted, expected)


def _compounds_as(other: list[str], words: list[str]) -> list[str]:
    """`words` with each run of them that spells one of `other`'s hyphenated compounds
    part by part joined into it: "black and yellow" is "black-and-yellow". Only that exact
    spelling: split for good, "ssh-agent" would share half its words with "ssh-keygen"."""
    for compound in {w for w in other if "-" in w.strip("-")}:
        parts = compound.split("-")
        n = len(parts)
        i = 0
        while i + n <= len(words):
            if words[i : i + n] == parts:
                words = [*words[:i], compound, *words[i + n :]]
            i += 1
    return words


def _literal(text: str) -> str:
    return "".join(text.split()).strip(QUOTES).lower()


def _bag_f1(predicted: list[str], expected: list[str]) -> float:
    """F1 of the multiset overlap of two bags (of words, or of characters)."""
    common = collections.Counter(predicted) & collections.Counter(expected)
    overlap = sum(common.values())
    if not overlap:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


# Chinese answers: words are not space-separated, so F1 is over characters (as CMRC 2018
# and DuReader score), punctuation and spaces of either script left out.
_NOT_COUNTED = set(string.punctuation) | set(
    "，。！？；：、（）《》【】…—·「」『』 \t\n\u201c\u201d\u2018\u2019"
)


def char_f1(prediction: str, gold: str) -> float:
    return _bag_f1(
        [c for c in prediction.lower() if c not in _NOT_COUNTED],
        [c for c in gold.lower() if c not in _NOT_COUNTED],
    )


def numbers_differ(first: str, second: str) -> bool:
    """Whether both write numbers and share none: "3 parts" and "2 parts", "20%" and "5%"
    are two answers, however many words (a unit, a noun) they share."""
    written = numbers.numbers(first), numbers.numbers(second)
    return all(written) and not written[0] & written[1]


def answer_f1(prediction: str, gold: str) -> float:
    """SQuAD's token F1, or character F1 when the gold answer is Chinese; 0 where the two
    name different numbers (`numbers_differ`), which SQuAD's F1 scores 0.5 for "2 parts"
    against "3 parts"."""
    if numbers_differ(prediction, gold):
        return 0.0
    return char_f1(prediction, gold) if has_han(gold) else token_f1(prediction, gold)


# Two answers this close are one: the bench's line between a right answer and a wrong one.
SAME_F1 = 0.5


def same_answer(first: str, second: str) -> bool:
    """Whether two answers to one question say the same thing (character F1 where either
    is Chinese, else token F1; both symmetric), never two that name different numbers."""
    if numbers_differ(first, second):
        return False
    if has_han(first) or has_han(second):
        return char_f1(first, second) >= SAME_F1
    return token_f1(first, second) >= SAME_F1


def stated_in(gold: str, text: str) -> bool:
    """Whether `text` writes the gold answer as it is written (its case, whole at both
    ends, spaces as any run of space): a passage that states the answer, where technical
    documents state one fact in several places ("the default compression level (-6)").
    Strict on purpose: "LESS" is not stated by every passage that says "less", nor "crc32"
    by one that only says "CRC32"."""
    words = gold.split()
    if not words:
        return False
    spelled = r"\s+".join(re.escape(w) for w in words)
    return re.search(rf"(?<![\w-]){spelled}(?!\w)", text) is not None
