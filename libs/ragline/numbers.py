"""Numbers as the same thing however they are written: "two", "2", "2,000", "two thousand",
"两" and "二" compare equal once read here. Grounding, the answer verifier and the bench's
scoring all read numbers through this module, so an answer "2 parts" copied from "two
parts" is neither refused as ungrounded nor scored as wrong."""

from __future__ import annotations

import re

_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90,
}  # fmt: skip
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_ORDINALS = {
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7,
    "eighth": 8, "ninth": 9, "tenth": 10, "twice": 2, "once": 1, "thrice": 3,
    "dozen": 12, "single": 1, "double": 2, "triple": 3, "half": 0.5,
}  # fmt: skip
_HAN_DIGITS = {"零": 0, "\u3007": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5,
               "六": 6, "七": 7, "八": 8, "九": 9}  # fmt: skip
_HAN_SCALES = {"十": 10, "百": 100, "千": 1_000, "万": 10_000, "亿": 100_000_000}

# A run of number words ("two hundred and fifty", "twenty-one") or one digit group
# ("2,000", "3.5"); a digit group is read with its thousands separators.
_WORD = "|".join(sorted({*_UNITS, *_SCALES}, key=len, reverse=True))
_WORD_RUN = re.compile(rf"\b(?:{_WORD})(?:(?:[\s-]+|\s+and\s+)(?:{_WORD}))*\b", re.IGNORECASE)
_DIGITS = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|\d+(?:\.\d+)?")
_HAN_RUN = re.compile(r"[零\u3007一二两三四五六七八九十百千万亿]+")
# Digits followed by a scale word: "3.5 million", "2 thousand".
_DIGITS_SCALED = re.compile(
    r"(\d+(?:\.\d+)?)\s+(hundred|thousand|million|billion)\b", re.IGNORECASE
)


def _words_value(run: str) -> float:
    total, current = 0.0, 0.0
    for word in re.split(r"[\s-]+", run.lower()):
        if word == "and" or not word:
            continue
        if word in _UNITS:
            current += _UNITS[word]
        elif word == "hundred":
            current = max(current, 1) * 100
        else:
            total += max(current, 1) * _SCALES[word]
            current = 0
    return total + current


def _han_value(run: str) -> float | None:
    if len(run) == 1 and run in _HAN_SCALES and run != "十":
        return None  # 万 alone is "ten thousand" too rarely to mean it (万一, 千万)
    if not any(char in _HAN_SCALES for char in run):
        return float("".join(str(_HAN_DIGITS[char]) for char in run))  # 二〇二四: 2024
    total, section, current = 0.0, 0.0, 0.0
    for char in run:
        if char in _HAN_DIGITS:
            current = current * 10 + _HAN_DIGITS[char] if current >= 10 else _HAN_DIGITS[char]
        elif char in ("万", "亿"):
            total += (section + current) * _HAN_SCALES[char]
            section = current = 0
        else:
            section += max(current, 1) * _HAN_SCALES[char]
            current = 0
    return total + section + current


def _digit_group(match: re.Match[str]) -> str:
    return _canonical(float(match.group(0).replace(",", "")))


def _word_run(match: re.Match[str]) -> str | None:
    """The run's number, None for a bare "one" ("no one", "one of them": rarely a count)."""
    run = match.group(0)
    return None if run.lower() == "one" else _canonical(_words_value(run))


def _scaled(match: re.Match[str]) -> str:
    return _canonical(float(match.group(1)) * _SCALES[match.group(2).lower()])


def _canonical(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def numbers(text: str) -> set[str]:
    """Every number `text` writes, canonical ("2,000" and "two thousand": "2000"; "3.0":
    "3"), whether in digits, English words or Chinese numerals. An ordinal or "twice" is
    not a count here: "the second" names a position, so it is left out."""
    found: set[str] = set()
    text = _DIGITS_SCALED.sub(_scaled, text)
    found.update(_digit_group(match) for match in _DIGITS.finditer(text))
    found.update(filter(None, (_word_run(match) for match in _WORD_RUN.finditer(text))))
    for match in _HAN_RUN.finditer(text):
        if match.start() > 0 and text[match.start() - 1] == "第":
            continue  # 第二: "the second", a position
        value = _han_value(match.group(0))
        if value is not None and match.group(0) not in ("一",):
            found.add(_canonical(value))
    return found


def word_runs(text: str) -> list[tuple[int, int, str]]:
    """Where `text` writes a number in words over several words ("three hundred sixty"):
    (start, end, its canonical value), for a reader that goes word by word."""
    return [
        (match.start(), match.end(), value)
        for match in _WORD_RUN.finditer(text)
        if re.search(r"\s", match.group(0)) and (value := _word_run(match)) is not None
    ]


def spelled_as_digits(text: str) -> str:
    """`text` with number words written as digits and thousands separators dropped ("two
    thousand parts" -> "2000 parts"), for comparing two texts word by word."""
    text = _DIGITS_SCALED.sub(_scaled, text)
    text = _DIGITS.sub(_digit_group, text)
    return _WORD_RUN.sub(lambda m: _word_run(m) or m.group(0), text)


def ordinal_value(word: str) -> float | None:
    """The value of an ordinal or multiplier word ("second": 2, "twice": 2), else None."""
    return _ORDINALS.get(word.lower())
