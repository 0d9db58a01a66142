"""Answers compared (the bench's scoring, and whether two models' answers agree): SQuAD's
token F1, with numbers and their units however written and the punctuation of technical
answers separating words."""

from __future__ import annotations

import pytest

from ragline.answer_match import answer_f1, normalise, same_answer, stated_in


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("inode", "--sort=inode"),  # the option's value for the option
        ("rsh", "rsh(1)"),  # a manual page's section
        ("512 bytes", "512-byte"),
        ("two", "2"),
        ("2,000", "2000"),
        ("U.S.", "US"),
        ("3 seconds", "3s"),  # a unit by its name, however abbreviated or glued
        ("64 kilobytes", "64KB"),
        ("10 min", "10 minutes"),
        ("60 percent", "60%"),
        ("32 bits", "32-bit"),
    ],
)
def test_the_same_answer_written_otherwise_is_right(answer, gold):
    assert answer_f1(answer, gold) >= 0.5


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("-u", "-k"),
        ("crc32", "crc64"),
        ("ZSTD_CLEVEL", "ZSTD_NBTHREADS"),  # identifiers stay whole
        ("--keep-old-files", "--keep-newer-files"),
        ("os.path.basename", "os.path.dirname"),
        ("3.5", "35"),
        ("1960", "1960s"),  # a decade, not 1960 seconds
        ("2 parts", "3 parts"),  # another number, however many words it shares
        ("64 MiB", "128 MiB"),
        ("2020年7月23", "2021年5月15日"),
    ],
)
def test_another_answer_is_wrong(answer, gold):
    assert answer_f1(answer, gold) < 0.5


def test_a_numbers_own_punctuation_keeps_it_whole():
    assert normalise("2,000.5 metres") == "2000.5 metre"
    assert normalise("The U.S. (1990s)") == "us 1990s"
    assert answer_f1("'+'", "+") == 1.0  # a literal with no word left compares as written


def test_units_are_one_word_by_their_name_and_stay_apart():
    assert normalise("3s") == normalise("3 secs") == "3 second"
    assert normalise("64 KiB") == "64 kibibyte" != normalise("64 KB")
    assert normalise("3 seconds") != normalise("3 minutes")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("the Vistula", "Vistula River"),
        ("two parts", "2"),
        ("维斯瓦河", "维斯瓦河流域"),
        ("'+'", "+"),
        ("black-and-yellow", "black and yellow"),
        ("25 feet", "a 25-foot wall"),
        ("3s", "3 seconds"),
    ],
)
def test_two_models_saying_one_thing_agree_either_way(first, second):
    assert same_answer(first, second) and same_answer(second, first)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("ZSTD_CLEVEL", "ZSTD_NBTHREADS"),
        ("1903", "1899"),
        ("维斯瓦河", "多瑙河"),
        ("the Danube", "not in the evidence"),
        ("ssh-agent", "ssh-keygen"),
        ("ssh agent", "ssh-keygen"),
        ("3 seconds", "5 seconds"),
        ("20%", "5%"),
        ("两个", "三个"),
    ],
)
def test_two_models_saying_two_things_disagree(first, second):
    assert not same_answer(first, second) and not same_answer(second, first)


@pytest.mark.parametrize(
    ("gold", "text"),
    [
        ("-6", "worse compression than the default compression level (-6)."),
        ("crc64", "Since the default is --check=crc64, you must use --check=none"),
        ("ZSTD_CLEVEL", "ZSTD_CLEVEL can be used to set the level between 1 and 19"),
        ("64 KB", "By default 64  KB of buffer space is used"),
    ],
)
def test_a_passage_that_writes_the_answer_states_it(gold, text):
    assert stated_in(gold, text)


@pytest.mark.parametrize(
    ("gold", "text"),
    [
        ("LESS", "less reads the whole file"),  # another case: another word
        ("crc32", "Integrity of the .xz headers is always verified with CRC32."),
        ("-6", "the presets -6e and -7 use"),  # a longer option
        ("6", "-6 is the default"),  # part of an option
        ("ZSTD_CLEVEL", "ZSTD_CLEVELS"),
        ("", "anything"),
    ],
)
def test_a_passage_that_only_shares_letters_with_the_answer_does_not(gold, text):
    assert not stated_in(gold, text)
