"""A number's unit read by its name however it is written (`ragline.units`)."""

from __future__ import annotations

import pytest

from ragline.units import glued, name_of, spelled_out


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("waits 3s", "waits 3 second"),
        ("1.5s", "1.5 second"),
        ("64KB buffer", "64 kilobyte buffer"),
        ("64 KB", "64 kilobyte"),
        ("2.5 GiB", "2.5 gibibyte"),
        ("10ms", "10 millisecond"),
        ("60%", "60 percent"),
        ("60 per cent of them", "60 percent of them"),
        ("a 25-foot wall", "a 25 foot wall"),
        ("1,024 bytes", "1,024 byte"),
    ],
)
def test_a_unit_after_a_number_is_read_by_its_name(text, read):
    assert spelled_out(text) == read


@pytest.mark.parametrize(
    "text",
    [
        "the 1960s",  # a decade
        "the 90s",
        "Boeing 747s",  # a plural of a model
        "F-16s",
        "3.5 m",  # metre, minute or million: left as written
        "5B",  # byte or billion
        "min and max",  # no number before it
        "seconds later",
    ],
)
def test_what_is_not_a_unit_after_a_number_is_left_as_written(text):
    assert spelled_out(text) == text


def test_a_token_of_a_number_and_its_unit_splits_where_the_unit_begins():
    assert glued("64KB") == (2, "kilobyte")
    assert glued("3s") == (1, "second")
    assert glued("1960s") is None and glued("KB") is None
    assert name_of("Secs") == "second" and name_of("m") is None
