"""Answers compared (the bench's scoring, and whether two models' answers agree): SQuAD's
token F1, with numbers however written and the punctuation of technical answers
separating words."""

from __future__ import annotations

import pytest

from ragline.answer_match import answer_f1, normalise, same_answer


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("inode", "--sort=inode"),  # the option's value for the option
        ("rsh", "rsh(1)"),  # a manual page's section
        ("512 bytes", "512-byte"),
        ("two", "2"),
        ("2,000", "2000"),
        ("U.S.", "US"),
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
    ],
)
def test_another_answer_is_wrong(answer, gold):
    assert answer_f1(answer, gold) < 0.5


def test_a_numbers_own_punctuation_keeps_it_whole():
    assert normalise("2,000.5 metres") == "2000.5 metres"
    assert normalise("The U.S. (1990s)") == "us 1990s"
    assert answer_f1("'+'", "+") == 1.0  # a literal with no word left compares as written


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("the Vistula", "Vistula River"),
        ("two parts", "2"),
        ("维斯瓦河", "维斯瓦河流域"),
        ("'+'", "+"),
        ("black-and-yellow", "black and yellow"),
        ("25 feet", "a 25-foot wall"),
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
    ],
)
def test_two_models_saying_two_things_disagree(first, second):
    assert not same_answer(first, second) and not same_answer(second, first)
