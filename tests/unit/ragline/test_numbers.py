"""Numbers read as the same thing however they are written."""

from __future__ import annotations

from ragline.numbers import numbers, spelled_as_digits, word_runs


def test_words_and_digits_give_one_canonical_number():
    assert numbers("two parts") == numbers("2 parts") == {"2"}
    assert numbers("2,000 men") == numbers("two thousand men") == {"2000"}
    assert numbers("twenty-one") == {"21"}
    assert numbers("two hundred and fifty") == {"250"}
    assert numbers("3.5 million") == numbers("3,500,000") == {"3500000"}
    assert numbers("version 3.0") == {"3"}


def test_chinese_numerals():
    assert numbers("两部分") == {"2"}
    assert numbers("三十五岁") == {"35"}
    assert numbers("二〇二四年") == {"2024"}
    assert numbers("中国第二长河") == set()  # an ordinal: a position, not a count


def test_one_as_a_pronoun_is_not_a_count():
    assert numbers("no one knows") == set()
    assert numbers("one of the largest") == set()


def test_spelled_as_digits_rewrites_number_words_in_place():
    assert spelled_as_digits("two thousand parts, 1,000 men") == "2000 parts, 1000 men"
    assert spelled_as_digits("Which one?") == "Which one?"


def test_word_runs_are_where_a_number_is_written_over_several_words():
    text = "It runs three hundred sixty schools, twenty-one of them new, and one more."
    assert [(text[a:b], value) for a, b, value in word_runs(text)] == [
        ("three hundred sixty", "360")
    ]
