"""Units of measure as the same thing however they are written: "3s", "3 sec" and "3
seconds"; "64KB", "64 KB" and "64 kilobytes"; "60%" and "60 percent" compare equal once
read here. Grounding, the answer verifier and the bench's scoring read a number's unit
through this module (as they read the number through `ragline.numbers`), so an answer
"3 seconds" from a passage that writes "3s" is neither refused as ungrounded, nor placed
nowhere in its passage, nor scored wrong against a gold "3s".

Only a unit written right after a number is read as one: "s" alone is a letter, "min" a
word of its own. Abbreviations that name several units are left as written ("m": metre,
minute or million; "B": byte or billion; "in", "g", "d", "us"), and so is an "s" glued to
a number that it makes plural ("1960s", "747s", "F-16s").
"""

from __future__ import annotations

import re

# The unit's name (singular) -> the ways it is written after a number (lower case).
_FORMS: dict[str, tuple[str, ...]] = {
    "second": ("s", "sec", "secs", "second", "seconds"),
    "millisecond": ("ms", "msec", "msecs", "millisecond", "milliseconds"),
    "microsecond": ("µs", "μs", "usec", "usecs", "microsecond", "microseconds"),
    "nanosecond": ("ns", "nsec", "nsecs", "nanosecond", "nanoseconds"),
    "minute": ("min", "mins", "minute", "minutes"),
    "hour": ("h", "hr", "hrs", "hour", "hours"),
    "bit": ("bit", "bits"),
    "byte": ("byte", "bytes"),
    "kilobyte": ("kb", "kbyte", "kbytes", "kilobyte", "kilobytes"),
    "kibibyte": ("kib", "kibibyte", "kibibytes"),
    "megabyte": ("mb", "mbyte", "mbytes", "megabyte", "megabytes"),
    "mebibyte": ("mib", "mebibyte", "mebibytes"),
    "gigabyte": ("gb", "gbyte", "gbytes", "gigabyte", "gigabytes"),
    "gibibyte": ("gib", "gibibyte", "gibibytes"),
    "terabyte": ("tb", "terabyte", "terabytes"),
    "tebibyte": ("tib", "tebibyte", "tebibytes"),
    "kilometre": ("km", "kilometre", "kilometres", "kilometer", "kilometers"),
    "metre": ("metre", "metres", "meter", "meters"),
    "centimetre": ("cm", "centimetre", "centimetres", "centimeter", "centimeters"),
    "millimetre": ("mm", "millimetre", "millimetres", "millimeter", "millimeters"),
    "mile": ("mi", "mile", "miles"),
    "foot": ("ft", "foot", "feet"),
    "yard": ("yd", "yds", "yard", "yards"),
    "kilogram": ("kg", "kgs", "kilogram", "kilograms", "kilogramme", "kilogrammes"),
    "pound": ("lb", "lbs"),
    "percent": ("%", "percent", "per cent", "pct"),
}
_NAME_OF = {form: name for name, forms in _FORMS.items() for form in forms}
_FORM = "|".join(re.escape(form) for form in sorted(_NAME_OF, key=len, reverse=True))
# A number, then its unit: glued ("3s", "64KB"), spaced ("64 KB") or hyphenated
# ("25-foot", the adjective form).
_NUMBER_UNIT = re.compile(
    rf"(?<![\w.])(\d+(?:[.,]\d+)*)(\s*-\s*|\s+|)({_FORM})(?![\w%])", re.IGNORECASE
)
_GLUED = re.compile(rf"(\d+(?:[.,]\d+)*)-?({_FORM})", re.IGNORECASE)


def name_of(word: str) -> str | None:
    """The unit `word` names when it follows a number ("KB": "kilobyte"), else None."""
    return _NAME_OF.get(word.lower())


def _a_plural(number: str, form: str, separator: str, before: str = "") -> bool:
    """Whether an "s" glued to a number makes it plural instead of naming seconds: a
    decade ("1960s", "90s"), a model ("747s", "F-16s"). Seconds written so are a small
    count ("3s", "15s", "1.5s")."""
    if form.lower() != "s" or separator:
        return False
    whole = number.split(".")[0]
    return len(whole) > 2 or number.endswith("0") or before == "-"


def glued(token: str) -> tuple[int, str] | None:
    """Where a token that is a number and its unit written together ("3s", "64KB",
    "25-foot") splits, and the unit's name; None for any other token ("1960s" is a
    decade)."""
    match = _GLUED.fullmatch(token)
    if match is None or _a_plural(match.group(1), match.group(2), ""):
        return None
    return match.end(1), _NAME_OF[match.group(2).lower()]


def spelled_out(text: str) -> str:
    """`text` with each unit that follows a number written as its name, apart from the
    number ("3s" -> "3 second", "64 KB" -> "64 kilobyte", "60%" -> "60 percent"), for
    comparing two texts word by word."""

    def name(match: re.Match[str]) -> str:
        number, separator, form = match.groups()
        before = match.string[match.start() - 1 : match.start()]
        if _a_plural(number, form, separator, before):
            return match.group(0)
        return f"{number} {_NAME_OF[form.lower()]}"

    return _NUMBER_UNIT.sub(name, text)
